"""`infer.py plan`: per jitted entry point of the decoder `generate` builds (over abstract models), a
thunk lowering it with the shapes and shardings a request of that size gets."""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import numpy as np

from dmtp_jax.decode.batch import pad_prompts
from dmtp_jax.decode.multi_round import pad_stop_ids
from dmtp_jax.decode.prefill import chunk_length
from dmtp_jax.decode.sampling import SamplingParams
from dmtp_jax.plan.models import abstract_args, shard_bytes
from dmtp_jax.sharding import at_shardings


@dataclasses.dataclass
class PlannedCall:
    name: str
    lower: Callable[[], jax.stages.Lowered]
    min_bytes: int              # per device: weights of the models it runs + caches, each read once
    calls: int = 1              # per request
    tokens_per_call: float | None = None
    parts: dict = dataclasses.field(default_factory=dict)


def request_shapes(cfg, batch: int, prompt_len: int, max_new_tokens: int, slack: int):
    """`(rows, prompt bucket, cache length)` of `batch` prompts of `prompt_len` tokens, exactly as
    `generate` pads them."""
    padded = pad_prompts([[0] * prompt_len] * batch, max_new_tokens, cfg.vocab_size,
                         cfg.max_position_embeddings, slack=slack)
    return padded.tokens_bt.shape[0], padded.tokens_bt.shape[1], padded.max_len


def inference_calls(decoder, batch: int, prompt_len: int, max_new_tokens: int, temperature: float = 0.0,
                    accept_len: float | None = None) -> list[PlannedCall]:
    """The jitted calls of one `generate` request on `decoder` (an `ARDecoder` or `SpecDecoder`
    over abstract models): a prefill chunk (`calls` = chunks per request), then the decode step,
    the round or the K-round dispatch."""
    target = decoder.target
    mesh = target.mesh
    sp = SamplingParams.make(temperature)
    greedy = sp.is_greedy
    key = jax.random.key(0)
    speculative = hasattr(decoder, "round")
    slack = decoder.slots if speculative else 8
    rows, bucket, max_len = request_shapes(target.cfg, batch, prompt_len, max_new_tokens, slack)
    chunk = chunk_length(bucket, decoder.prefill_chunk)
    chunks = -(-bucket // chunk)
    tokens = jax.ShapeDtypeStruct((rows, chunk), np.int32)
    row_ids = jax.ShapeDtypeStruct((rows,), np.int32)
    start = np.int32(0)
    args = lambda *xs: abstract_args(xs, mesh)  # noqa: E731
    weights = {"target": shard_bytes(target.state)}
    if speculative:
        for name in ("drafter", "mtp", "fusion", "draft_head", "draft_model"):
            loaded = getattr(decoder, name)
            if loaded is not None:
                weights[name] = shard_bytes(loaded.state)
        shapes = jax.eval_shape(lambda: decoder.new_state(rows, max_len))
        state = at_shardings(shapes, decoder.state_shardings(shapes))
        caches = {"target_cache": shard_bytes(state.target_cache)}
        if state.mtp_cache is not None:
            caches["mtp_cache"] = shard_bytes(state.mtp_cache)
        if state.draft_cache is not None:
            caches["draft_cache"] = shard_bytes(state.draft_cache)
        read = dict(caches)
        if state.ctx_cache is not None:     # the drafter reads its context window, not the whole cache
            caches["ctx_cache"] = shard_bytes(state.ctx_cache)
            read["ctx_cache"] = caches["ctx_cache"] * min(1.0, decoder.context_window / max_len)
        parts = {**{f"weights:{k}": v for k, v in weights.items()}, **{f"cache:{k}": v for k, v in caches.items()}}
        minimum = int(sum(weights.values()) + sum(read.values()))
        states, knobs = decoder.model_states(), decoder.knobs()
        active = jax.ShapeDtypeStruct((rows,), np.bool_)
        limits = jax.ShapeDtypeStruct((rows,), np.int32)
        rounds_needed = -(-max_new_tokens // (accept_len or 1.0))
        calls = [PlannedCall("prefill", lambda: decoder.prefill_step.lower(*args(states, tokens, row_ids, start,
                                                                                row_ids), state, *args(sp, key),
                                                                           greedy=greedy),
                             minimum, chunks, rows * chunk, parts)]
        per_round = rows * accept_len if accept_len else None
        if decoder.rounds_per_dispatch > 1:
            k = decoder.rounds_per_dispatch
            stop = pad_stop_ids(target.cfg.eos_token_ids)
            calls.append(PlannedCall(
                "multi_round", lambda: decoder.multi_round.lower(*args(states), state, *args(active, limits, sp, key,
                                                                                          np.int32(1), stop, knobs),
                                                                 greedy=greedy),
                minimum * k, int(-(-rounds_needed // k)), per_round and per_round * k, parts))
        else:
            calls.append(PlannedCall(
                "round", lambda: decoder.round.lower(*args(states), state, *args(active, limits, sp, key, np.int32(1),
                                                                                 knobs), greedy=greedy),
                minimum, int(rounds_needed), per_round, parts))
        return calls
    shapes = jax.eval_shape(lambda: decoder.caches.new(rows, max_len))
    cache = at_shardings(shapes, decoder.caches.shardings(shapes))
    weights_b, cache_b = shard_bytes(target.state), shard_bytes(cache)
    parts = {"weights:target": weights_b, "cache:target_cache": cache_b}
    return [
        PlannedCall("prefill", lambda: decoder.prefill_step.lower(*args(target.state, tokens, start, row_ids), cache,
                                                                  *args(row_ids, sp, key), greedy=greedy),
                    weights_b + cache_b, chunks, rows * chunk, parts),
        PlannedCall("decode_step", lambda: decoder.decode_step.lower(*args(target.state, row_ids, row_ids),
                                                                     cache, *args(sp, key), greedy=greedy),
                    weights_b + cache_b, max_new_tokens - 1, rows, parts),
    ]
