"""The serving engine's exact prefix cache (`dmtp_jax/serve/prefix_cache.py`): the store's keys,
lookup rules, LRU budget and row extraction (no model), and a two-turn chat through the `Engine`
with and without the cache on conftest's tiny hybrid Qwen3.5 target (Gated DeltaNet + gated
attention, native MTP) with a random DFlash drafter and DMTP fusion, for ar and dmtp:
the same tokens, the second turn resumed from the first turn's finished row, a greedy repeat
prefilling nothing, a request stopped mid-round, a sampled conversation, bounded compiles; and
`/metrics`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dmtp_jax.serve.engine import Engine, Request
from dmtp_jax.serve.prefix_cache import PrefixCache, prefix_cache_bytes, prefix_key
from dmtp_jax.serve.rows import batch_axes, extract_row, insert_row

PROMPTS = [[5, 9, 31, 4, 77, 2, 18], [100, 101, 7, 66, 12, 9, 43, 8, 8, 1, 60, 21, 94]]
NEW_TEXT = [[11, 12, 13], [70, 71]]
MAX_TOKENS = 12
MAX_MODEL_LEN = 120


# ---- the store, no model ---------------------------------------------------------------------------
def row(value: float, size: int = 4) -> dict:
    return {"k": jnp.full((1, size), value)}          # 4 float32: 16 bytes


def test_lookup_takes_the_longest_exact_prefix_and_repeats_only_greedy():
    cache = PrefixCache(1 << 20)
    cache.offer((1, 2), row(1), greedy=False)
    cache.offer((1, 2, 3, 4), row(2), greedy=True)
    hit = cache.lookup([1, 2, 3, 4, 5], greedy=False)
    assert (hit.snapshot.tokens, hit.start, hit.ready) == ((1, 2, 3, 4), 3, False)
    # the key equal to the prompt: one token short, the pending token is re-run
    assert cache.lookup([1, 2, 3, 4], greedy=False).start == 3
    # a greedy prompt of the key but its pending token: used as is; a sampled one resumes from (1, 2)
    ready = cache.lookup([1, 2, 3], greedy=True)
    assert ready.ready and ready.start == 3 and ready.snapshot.tokens[-1] == 4
    assert cache.lookup([1, 2, 3], greedy=False).start == 1
    assert cache.lookup([1], greedy=False) is None and cache.lookup([2, 1, 3], greedy=True) is None
    assert cache.lookup([1, 3, 3, 4], greedy=False) is None                   # no partial match
    m = cache.metrics()
    assert m["hits"] == 4 and m["lookups"] == 7 and m["hit_tokens"] == 3 + 3 + 3 + 1


def test_budget_evicts_the_least_recently_used():
    cache = PrefixCache(48)                                    # three 16-byte snapshots
    for i in range(3):
        assert cache.offer((i, 9), row(i), greedy=False)
    assert cache.lookup([0, 9, 1], greedy=False) is not None   # (0, 9) used: (1, 9) is the oldest now
    assert cache.offer((3, 9), row(3), greedy=False)
    assert cache.lookup([1, 9, 1], greedy=False) is None and cache.lookup([0, 9, 1], greedy=False) is not None
    assert not cache.offer((4, 9), row(4, size=16), greedy=False)      # larger than the whole budget
    assert not cache.offer((3, 9), row(5), greedy=False)               # known: only marked used
    m = cache.metrics()
    assert (m["entries"], m["bytes"], m["evicted"], m["budget_bytes"]) == (3, 48, 1, 48)
    assert prefix_cache_bytes(1.5) == 3 << 29 and prefix_key([1, 2]) != prefix_key([1, 2, 0])


def test_extract_row_inverts_insert_row():
    big = {"kv": jnp.arange(2 * 3 * 4.0).reshape(2, 3, 4), "n": jnp.arange(3)}
    axes = batch_axes({"kv": jnp.zeros((2, 1, 4)), "n": jnp.zeros(1)}, {"kv": jnp.zeros((2, 2, 4)), "n": jnp.zeros(2)})
    one = extract_row(axes, big, 1)
    assert one["kv"].shape == (2, 1, 4) and one["n"].tolist() == [1]
    back = insert_row(jax.tree.map(jnp.zeros_like, big), one, 1)
    assert np.array_equal(back["kv"][:, 1], big["kv"][:, 1]) and back["kv"][:, 0].sum() == 0


# ---- a two-turn chat through the engine, tiny hybrid target ----------------------------------------
@pytest.fixture(scope="module")
def hybrid_models(tiny_qwen3_5_dir):
    """conftest's tiny Qwen3.5 target and its MTP head (peaked LM-head rows: drafts are partly
    accepted), a random one-layer DFlash drafter and DMTP fusion."""
    from dmtp_jax.checkpoint.dflash_ckpt import init_drafter
    from dmtp_jax.checkpoint.dmtp_ckpt import init_fusion
    from dmtp_jax.checkpoint.hf import load_target
    from dmtp_jax.checkpoint.mtp_ckpt import load_mtp
    from dmtp_jax.models.drafter_shape import default_drafter_config

    target = load_target(tiny_qwen3_5_dir)
    cfg = target.cfg
    assert cfg.linear_layers and cfg.attention_layers         # hybrid: Gated DeltaNet + gated attention
    drafter = init_drafter(default_drafter_config(cfg, num_layers=1, block_size=4), seed=2)
    return {"target": target, "drafter": drafter, "mtp": load_mtp(tiny_qwen3_5_dir, cfg),
            "fusion": init_fusion("dmtp", cfg.hidden_size, cfg.rms_norm_eps, seed=3)}


@pytest.fixture(scope="module")
def decoders(hybrid_models):
    """ar and dmtp on the hybrid target (dmtp's state holds every cache mtp and dflash have: target
    K/V and DeltaNet states, MTP cache and hidden, drafter context), built once for the module."""
    from dmtp_jax.decode import make_decoder
    m = hybrid_models
    return {"ar": make_decoder("ar", m["target"]),
            "dmtp": make_decoder("dmtp", m["target"], m["drafter"], mtp=m["mtp"], fusion=m["fusion"])}


def engine(decoder, cache: bool) -> Engine:
    """Two rows in one bucket (fewer compiles): turn 1's prompts are prefilled as a group and finish
    in rows 0 and 1; a resumed request is prefilled on its own 1-row state."""
    return Engine(decoder, max_batch_size=2, buckets=(2,), max_model_len=MAX_MODEL_LEN, stop_ids=[],
                  prefix_cache_gb=0.01 if cache else 0.0)


def serve_all(engine: Engine, requests: list[Request]) -> list[list[int]]:
    for r in requests:
        engine.add(r)
    while engine.busy:
        engine.step()
    return [r.output_ids for r in requests]


def chat(engine: Engine, stop: int, sampled: bool) -> list[list[int]]:
    """Turn 1 (the second request stops at `stop`, mid-round for a speculative decoder), turn 2
    (prompt + answer + new text), then turn 1's first prompt again (a greedy repeat); with `sampled`
    a sampled two-turn conversation after them. Every output, in order."""
    first = serve_all(engine, [Request(PROMPTS[0], MAX_TOKENS), Request(PROMPTS[1], MAX_TOKENS, stop_ids=(stop,))])
    second = [p + a + t for p, a, t in zip(PROMPTS, first, NEW_TEXT)]
    outs = first + serve_all(engine, [Request(p, MAX_TOKENS) for p in second])
    outs += serve_all(engine, [Request(PROMPTS[0], MAX_TOKENS)])
    if sampled:
        conv = Request(PROMPTS[1], MAX_TOKENS, temperature=1.0, top_p=0.9, seed=4)
        outs += serve_all(engine, [conv])
        outs += serve_all(engine, [Request(PROMPTS[1] + conv.output_ids + NEW_TEXT[0], MAX_TOKENS, temperature=1.0,
                                           top_p=0.9, seed=5)])
    return outs


@pytest.mark.parametrize("method", ["ar", "dmtp"])
def test_two_turn_chat_with_the_cache_equals_without(method, decoders):
    """Greedy outputs with the cache equal those without (and so `generate`'s: tests/test_serve.py);
    the sampled conversation (ar) draws the same tokens: the resumed prefill draws the first token
    with the request's key from the same logits, later draws are the engine's round keys."""
    decoder = decoders[method]
    stop = serve_all(engine(decoder, False), [Request(PROMPTS[1], MAX_TOKENS)])[0][4]
    sampled = method == "ar"
    want = chat(engine(decoder, False), stop, sampled)
    cached = engine(decoder, True)
    got = chat(cached, stop, sampled)
    assert got == want
    m = cached.prefix_cache.metrics()
    # turn 2 resumes past the answer (the finished row) or, when the row ran past its stop token
    # mid-round (speculative), from the prefill's snapshot (prompt + first token); the repeat: all of it
    turn2 = [len(PROMPTS[0]) + MAX_TOKENS - 1, len(PROMPTS[1]) + (4 if method == "ar" else 0)]
    repeat = len(PROMPTS[0])
    sampled_turn2 = len(PROMPTS[1]) + MAX_TOKENS - 1 if sampled else 0
    assert m["hits"] == 3 + sampled and m["hit_tokens"] >= sum(turn2) + repeat + sampled_turn2, m
    assert method != "ar" or m["hit_tokens"] == sum(turn2) + repeat + sampled_turn2, m
    assert 0 < m["bytes"] <= m["budget_bytes"] and m["entries"] >= 4
    counts = cached.compile_counts()      # the decoder's bank: shared by the engines of this module
    assert counts["extract_row"] <= len(cached.buckets) and counts["copy_row"] == 1, counts
    # prefill: the prompt bucket (2 rows) and one resume bucket (`resume_tokens`, 1 row), greedy (and
    # sampled); one round, greedy (and sampled)
    assert counts["prefill"] <= 2 * (1 + sampled) and counts[f"round/{method}"] <= 1 + sampled, counts


def test_warm_up_compiles_the_resumes_and_metrics_show_the_cache(decoders):
    """`serve`'s warm-up (`Engine.warm_up`, here greedy and the shortest prompt bucket) compiles
    the row extraction, the row copy and the resume buckets: later hits compile nothing, the cache is
    left empty; `/metrics` shows hits, hit tokens, bytes and the budget."""
    from dmtp_jax.serve.metrics import ServerMetrics

    cached = engine(decoders["ar"], True)
    cached.warm_up(every_bucket=False, sampled=False)
    counts = cached.compile_counts()
    assert counts["extract_row"] == len(cached.buckets) and counts["copy_row"] == 1, counts
    assert cached.prefix_cache.metrics()["entries"] == 0
    answer = serve_all(cached, [Request(PROMPTS[0], 3)])[0]
    serve_all(cached, [Request(PROMPTS[0], 3)])                              # a greedy repeat
    serve_all(cached, [Request(PROMPTS[0] + answer + [9] * 20, 3)])          # resumes 21 tokens: bucket 32
    assert cached.compile_counts() == counts
    text = ServerMetrics().render(cached)
    hit_tokens = len(PROMPTS[0]) + len(PROMPTS[0]) + len(answer) - 1
    assert "dmtp_prefix_cache_hits_total 2" in text and f"dmtp_prefix_cache_hit_tokens_total {hit_tokens}" in text
    assert "dmtp_prefix_cache_bytes " in text and "dmtp_prefix_cache_budget_bytes 10737418" in text
