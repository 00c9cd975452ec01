"""The speculative decode engine: one jitted round over fixed buffers, for every drafting method
(the proposer is the only thing a method chooses: no method branches here). It checks the options
(`check_spec_options`), binds the frozen `RoundSetup` to the jitted entry points (`prefill_step`,
`round`, `multi_round`) and runs the host loop: one host transfer per round, one compile per
(batch bucket, cache length, method, greedy/sampled)."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import time
from typing import Callable

import jax
import numpy as np

from dmtp_jax.checkpoint.hf import LoadedModel
from dmtp_jax.counted_jit import counted_jit
from dmtp_jax.decode.ar import GenerationResult
from dmtp_jax.decode.batch import RequestError, StopTracker, pad_prompts
from dmtp_jax.decode.caches import TargetCaches, kv_cache_shape, kv_cache_value_dim, new_kv_cache
from dmtp_jax.decode.drafting import catch_up, deferred_widths, new_deferred
from dmtp_jax.decode.multi_round import feed_rounds, pad_stop_ids, run_rounds
from dmtp_jax.decode.prefill import DEFAULT_PREFILL_CHUNK, prefill_chunks
from dmtp_jax.decode.probe import ExactnessCheck
from dmtp_jax.decode.proposers import PROPOSERS, Proposer, RoundKnobs, make_proposer
from dmtp_jax.decode.round import SpecState, constrain_state, merge_models, prefill_step, spec_round, state_shardings
from dmtp_jax.decode.sampling import SamplingParams
from dmtp_jax.decode.stats import acceptance_stats, first_candidate_by_source
from dmtp_jax.models.draft_head import head_name
from dmtp_jax.options import (SPEC_METHODS, VERIFY_MODES, adaptive_threshold_for,  # noqa: F401
                              check_adaptive_threshold, check_draft_vocab, check_method, check_models_given,
                              check_prefill_chunk, check_rounds_per_dispatch, check_verify_mode,
                              verify_slots)
from dmtp_jax.sharding import replicated

DEFAULT_CONTEXT_WINDOW = 4096


def check_spec_options(method: str, drafter=None, mtp=None, fusion=None, *, block_size: int | None = None,
                       mtp_steps: int = 4, verify: str = "rejection", adaptive_threshold: float | None = None,
                       rounds_per_dispatch: int = 1, prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
                       draft_model=None, draft_head=None) -> tuple[int, float | None]:
    """Every option of a `SpecDecoder`, checked in one place (rules: `dmtp_jax.options`): returns
    `(verify slots, adaptive threshold or None)`; raises `RequestError` naming the bad option.

    Example:
        >>> check_spec_options("mtp", mtp=object(), mtp_steps=3)
        (4, None)
        >>> check_spec_options("mtp", mtp=object(), mtp_steps=0)
        Traceback (most recent call last):
        ...
        dmtp_jax.errors.RequestError: --mtp-steps must be in [1, 15], got 0
    """
    check_verify_mode(verify)
    check_method(method, SPEC_METHODS, what="speculative method")
    check_rounds_per_dispatch(rounds_per_dispatch)
    check_prefill_chunk(prefill_chunk)
    check_models_given(method, drafter=drafter, mtp=mtp, fusion=fusion, draft_model=draft_model, draft_head=draft_head)
    slots = verify_slots(method, mtp_steps=mtp_steps, block_size=block_size,
                         drafter_block_size=None if drafter is None else drafter.cfg.block_size)
    threshold = adaptive_threshold_for(method, adaptive_threshold,
                                       None if fusion is None else fusion.cfg.get("threshold"))
    return slots, threshold


@dataclasses.dataclass(frozen=True)
class RoundSetup:
    """What the jitted entry points read besides their arguments; frozen, bound before jitting."""
    graphdefs: tuple              # (target, drafter, mtp, fusion, draft_head, draft_model); None where unused
    mesh: object
    proposer: Proposer
    verify_mode: str
    rounds_per_dispatch: int
    logprobs: bool = False        # rounds and prefills also return the target's `TokenLogprobs` (a serve bank's)


def _pin(mesh, x):
    return jax.lax.with_sharding_constraint(x, replicated(mesh))


def prefill_entry(setup: RoundSetup, states, tokens_bt, next_b, start, lengths_b, state: SpecState, sp, key,
                  greedy: bool = False, defer: bool = False) -> SpecState:
    """`round.prefill_step` on the merged models, the state pinned at its shardings (jitted as
    `SpecDecoder.prefill_step`; `defer`: a lean prefill, as a switching `RoundBank` runs it)."""
    models = merge_models(setup.graphdefs, states)
    out = prefill_step(models, tokens_bt, next_b, start, lengths_b, state, sp, key, greedy, defer, setup.logprobs)
    if setup.logprobs:
        return constrain_state(setup.mesh, out[0]), jax.tree.map(functools.partial(_pin, setup.mesh), out[1])
    return constrain_state(setup.mesh, out)


def catch_up_entry(setup: RoundSetup, states, state: SpecState) -> SpecState:
    """`drafting.catch_up` on the merged models, the state pinned at its shardings (jitted as
    `RoundBank.catch_up_step`)."""
    return constrain_state(setup.mesh, catch_up(merge_models(setup.graphdefs, states), state))


def _keyed_round(setup: RoundSetup, models, knobs, state, active_b, limits_b, sp, key, greedy):
    state, *out = spec_round(setup.proposer, setup.verify_mode, models, state, active_b, limits_b, sp, key, greedy,
                             knobs, setup.logprobs)
    mesh = setup.mesh
    return (constrain_state(mesh, state), *jax.tree.map(functools.partial(_pin, mesh), tuple(out)))


def round_entry(setup: RoundSetup, states, state: SpecState, active_b, limits_b, sp, base_key, round_index, knobs,
                greedy: bool):
    """Round `round_index` of a request (`round.spec_round`, key `fold_in(base_key, round_index)`),
    jitted as `SpecDecoder.round`: `(state, tokens [B, n], accepted [B], t1_from_mtp [B])`."""
    models = merge_models(setup.graphdefs, states)
    key = jax.random.fold_in(base_key, round_index)
    return _keyed_round(setup, models, knobs, state, active_b, limits_b, sp, key, greedy)


def multi_round_entry(setup: RoundSetup, states, state: SpecState, active_b, limits_b, sp, base_key, first_round,
                      stop_ids_s, knobs, greedy: bool, max_rounds=None):
    """Up to `setup.rounds_per_dispatch` rounds on device (`multi_round.run_rounds`; up to `max_rounds`,
    traced, when given), jitted as `SpecDecoder.multi_round` and `RoundBank.multi_round`."""
    models = merge_models(setup.graphdefs, states)
    return run_rounds(functools.partial(_keyed_round, setup, models, knobs), state, active_b, limits_b, sp, base_key,
                      first_round, stop_ids_s, rounds=setup.rounds_per_dispatch, slots=setup.proposer.slots,
                      greedy=greedy, commit_cap=knobs.commit_cap, max_rounds=max_rounds, extras=setup.logprobs)


def _used(proposer: Proposer, target, drafter, mtp, fusion, draft_head, draft_model=None) -> tuple:
    """`(target, drafter, mtp, fusion, draft_head, draft_model)` with the models the proposer does not
    need set to None (`draft_head` None: the full LM head drafts)."""
    needs = proposer.needs
    return (target, drafter if needs["drafter"] else None, mtp if needs["mtp"] else None,
            fusion if needs["fusion"] else None, draft_head, draft_model if needs["draft_model"] else None)


def new_spec_state(caches: TargetCaches, drafter: LoadedModel | None, mtp: LoadedModel | None, batch: int,
                   max_len: int, draft_model: LoadedModel | None = None, defer_window: int = 0,
                   drafting_caches: bool = True, token_buffer: bool = True) -> SpecState:
    """A zero `SpecState` of `batch` rows and `max_len` slots (with the drafter's, the MTP's and a draft
    model's caches where those models are given, and the token buffer where `token_buffer`: a state
    whose rounds never read it leaves it out, None, and no round writes it), placed as the jitted calls
    leave it. `defer_window` > 0: plain rounds defer the drafting caches' work for up to that many
    rounds (`drafting.DeferredRows`). `drafting_caches=False` (with a defer window): those caches and
    the MTP hidden left out (None), the deferred buffer kept: a lean prefill's state, which writes
    none of them (`round.prefill_step`'s `defer`)."""
    target = caches.target
    mesh = target.mesh
    rep = replicated(mesh)    # placed as the jitted calls leave them: one compile
    zeros = lambda *shape: jax.device_put(np.zeros((batch, *shape), np.int32), rep)  # noqa: E731  (own buffers)
    deferred = None
    if defer_window and (drafter, mtp, draft_model) != (None, None, None):
        hidden, captured = deferred_widths(target.cfg, None if drafter is None else drafter.cfg)
        deferred = new_deferred(mesh, batch, defer_window, hidden, captured, target.state_dtype)
    elif not drafting_caches:
        raise ValueError("a state without its drafting caches needs a defer window to hold their rows")
    if not drafting_caches:
        drafter = mtp = draft_model = None
    ctx = mtp_cache = mtp_h = draft_cache = None
    if drafter is not None:
        d = drafter.cfg
        ctx = new_kv_cache(mesh, kv_cache_shape(d, batch, max_len, mesh, d.num_hidden_layers), drafter.state_dtype)
        if d.chained:       # EAGLE-3: the hidden its chain starts from
            mtp_h = jax.device_put(np.zeros((batch, d.hidden_size), drafter.state_dtype), rep)
    if mtp is not None:
        c = target.cfg
        mtp_cache = new_kv_cache(mesh, kv_cache_shape(c, batch, max_len, mesh, mtp.cfg.cache_layers), mtp.state_dtype,
                                 kv_cache_value_dim(c))
        mtp_h = jax.device_put(np.zeros((batch, mtp.cfg.hidden_size), mtp.state_dtype), rep)
    if draft_model is not None:
        draft_cache = TargetCaches(draft_model).new(batch, max_len)
    return SpecState(caches.new(batch, max_len), ctx, mtp_cache, mtp_h, zeros(), zeros(),
                     zeros(max_len) if token_buffer else None, draft_cache, deferred)


def to_host(tree):
    """Every array of `tree` on the host in one transfer (`jax.device_get`): the round's only sync."""
    return jax.device_get(tree)


class SpecDecoder:
    """Speculative decoding of a target with `method` in `SPEC_METHODS`.

    `drafter` (DFlash / DFlash2) serves dflash and dmtp*; `mtp` serves mtp and dmtp*; `fusion`
    (`checkpoint.dmtp_ckpt`) the dmtp* methods; `draft_model` (a smaller target of the same
    vocabulary) draft-model; `lookup` needs none; `draft_head`: the drafting side's efficient or int8
    LM head (None: the full head). `verify`: sampled verification, "rejection", "block" or
    "target-only" (greedy is always exact match). `strict`: raise `InexactBackendError` when the
    exactness probe finds the backend inexact (default: decode plainly). `adaptive_threshold`
    (dmtp-adaptive, changeable between requests): the MTP top-1 probability from which a row takes
    MTP's T1 (default: the drafter's calibrated threshold, else 0.5). `rounds_per_dispatch` K > 1:
    up to K rounds per jitted call (`decode/multi_round.py`), same outputs and statistics as K = 1."""

    def __init__(self, target: LoadedModel, drafter: LoadedModel | None = None, *, method: str = "dflash",
                 mtp: LoadedModel | None = None, fusion: LoadedModel | None = None,
                 block_size: int | None = None, mtp_steps: int = 4, verify: str = "rejection",
                 context_window: int = DEFAULT_CONTEXT_WINDOW, strict: bool = False,
                 adaptive_threshold: float | None = None, rounds_per_dispatch: int = 1,
                 prefill_chunk: int = DEFAULT_PREFILL_CHUNK, draft_head: LoadedModel | None = None,
                 draft_model: LoadedModel | None = None):
        slots, threshold = check_spec_options(method, drafter, mtp, fusion, block_size=block_size,
                                              mtp_steps=mtp_steps, verify=verify,
                                              adaptive_threshold=adaptive_threshold,
                                              rounds_per_dispatch=rounds_per_dispatch, prefill_chunk=prefill_chunk,
                                              draft_model=draft_model, draft_head=draft_head)
        if draft_model is not None:
            check_draft_vocab(target.cfg.vocab_size, draft_model.cfg.vocab_size, draft_model.model_dir or "")
        self.adaptive_threshold = threshold
        self.target, self.drafter, self.mtp, self.fusion = target, drafter, mtp, fusion
        self.draft_head, self.draft_model = draft_head, draft_model
        self.caches = TargetCaches(target)
        self.prefill_chunk = int(prefill_chunk)
        proposer = make_proposer(method, slots, context_window)
        self.exactness = ExactnessCheck(target, proposer.slots, strict=strict, method=proposer.method,
                                        prefill_chunk=self.prefill_chunk)
        graphdefs = tuple(None if m is None else m.graphdef
                          for m in _used(proposer, target, drafter, mtp, fusion, draft_head, draft_model))
        self.setup = RoundSetup(graphdefs, target.mesh, proposer, verify, int(rounds_per_dispatch))
        self.prefill_step = counted_jit(functools.partial(prefill_entry, self.setup), donate_argnames=("state",),
                                        static_argnames=("greedy",))
        self.round = counted_jit(functools.partial(round_entry, self.setup), donate_argnames=("state",),
                                 static_argnames=("greedy",))
        self.multi_round = counted_jit(functools.partial(multi_round_entry, self.setup), donate_argnames=("state",),
                                       static_argnames=("greedy",))
        self.last_state: SpecState | None = None

    # ---- the static setup, read-only ---------------------------------------------------------
    proposer = property(lambda self: self.setup.proposer, doc="The method's proposer (`decode/proposers.py`).")
    method = property(lambda self: self.setup.proposer.method, doc="The drafting method.")
    slots = property(lambda self: self.setup.proposer.slots, doc="Verify slots: the pending token + drafts.")
    block_size = slots
    context_window = property(lambda self: self.setup.proposer.window, doc="Drafter context positions.")
    verify_mode = property(lambda self: self.setup.verify_mode, doc="The sampled verifier.")
    rounds_per_dispatch = property(lambda self: self.setup.rounds_per_dispatch, doc="Rounds per jitted call.")

    # ---- state -------------------------------------------------------------------------------
    def new_state(self, batch: int, max_len: int) -> SpecState:
        """A zero state of `batch` rows and `max_len` slots, placed as the jitted calls leave it: the
        caches of the models the method runs, the token buffer only where its proposer reads it."""
        needs = self.proposer.needs
        return new_spec_state(self.caches, self.drafter if needs["drafter"] else None,
                              self.mtp if needs["mtp"] else None, batch, max_len,
                              self.draft_model if needs["draft_model"] else None,
                              token_buffer=self.proposer.READS_TOKENS)

    def state_shardings(self, st: SpecState) -> SpecState:
        """The sharding of every array of a state (or of its shapes), as a `SpecState` tree."""
        return state_shardings(self.target.mesh, st)

    def model_states(self) -> tuple:
        """`(target, drafter, mtp, fusion, draft_head, draft_model)` weights as the jitted entry points take
        them."""
        return tuple(None if m is None else m.state
                     for m in _used(self.proposer, self.target, self.drafter, self.mtp, self.fusion, self.draft_head,
                                    self.draft_model))

    def knobs(self) -> RoundKnobs:
        """The proposers' traced knobs from the decoder's current settings (`adaptive_threshold`)."""
        threshold = self.adaptive_threshold
        return RoundKnobs.make(None if threshold is None else check_adaptive_threshold(threshold))

    def prefill(self, states, tokens_bt, lengths_b, state: SpecState, sp, key, greedy: bool = False) -> SpecState:
        """The padded prompts through target, MTP and drafter context, chunk by chunk: the state (donated)
        with each row's first token pending."""
        for start, chunk_bt, next_b in prefill_chunks(tokens_bt, self.prefill_chunk):
            state = self.prefill_step(states, chunk_bt, next_b, start, lengths_b, state, sp, key, greedy=greedy)
        return state

    # ---- host loop ---------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], max_new_tokens: int, sampling: SamplingParams | None = None,
                 seed: int = 0, stop_ids=None,
                 on_tokens: Callable[[int, list[int]], None] | None = None) -> GenerationResult:
        """Speculative generation; `ARDecoder.generate`'s contract plus `stats["acceptance_lengths"]` (per
        row, the tokens each verify round committed)."""
        cfg = self.target.cfg
        sp = sampling or SamplingParams.make()
        greedy = sp.is_greedy
        stop_ids = cfg.eos_token_ids if stop_ids is None else stop_ids
        knobs = self.knobs()
        batch = pad_prompts(prompts, max_new_tokens, cfg.vocab_size, cfg.max_position_embeddings,
                            slack=self.slots)
        probing = None                  # block == chain on this backend? (once per decoder)
        if self.exactness.probed:
            gate = self.exactness.gate()
            if not gate.engaged:
                return gate.plain_generate(prompts, max_new_tokens, sampling, seed, stop_ids, on_tokens)
        else:   # first request: the probe compiles and runs in a thread while this one compiles prefill and round
            probing = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="dmtp-probe")
            gate_future = probing.submit(self.exactness.gate)
        rows = batch.tokens_bt.shape[0]
        tracker = StopTracker(batch.num_rows, max_new_tokens, stop_ids)
        base_key = jax.random.key(seed)
        acceptance: list[list[int]] = [[] for _ in range(batch.num_rows)]
        first_source: list[list[bool]] = [[] for _ in range(batch.num_rows)]    # T1 from MTP, per round
        limits = (batch.lengths_b + max_new_tokens).astype(np.int32)
        stop_ids_s = pad_stop_ids(stop_ids)
        multi = self.rounds_per_dispatch > 1

        t0 = time.perf_counter()
        states = self.model_states()
        state = self.prefill(states, batch.tokens_bt, batch.lengths_b, self.new_state(rows, batch.max_len),
                             sp, jax.random.fold_in(base_key, 0), greedy=greedy)
        first = to_host(state.pending_b)
        ttft = time.perf_counter() - t0
        if probing is not None:         # nothing is committed (or streamed) before the probe's verdict
            try:
                if max_new_tokens > 1 and multi:   # the same for the K-round loop
                    self.multi_round.lower(states, state, np.zeros(rows, bool), limits, sp, base_key, np.int32(1),
                                           stop_ids_s, knobs, greedy=greedy).compile()
                elif max_new_tokens > 1:  # compiled now, reused by the first round (not counted until it runs)
                    self.round.lower(states, state, np.zeros(rows, bool), limits, sp, base_key, np.int32(1), knobs,
                                     greedy=greedy).compile()
                gate = gate_future.result()
            finally:
                probing.shutdown(wait=True)
            if not gate.engaged:
                return gate.plain_generate(prompts, max_new_tokens, sampling, seed, stop_ids, on_tokens)
        for row in range(batch.num_rows):
            kept = tracker.add(row, [first[row]])
            if kept and on_tokens:
                on_tokens(row, kept)
        rounds = 0
        t1 = time.perf_counter()
        while not tracker.all_done:
            active = np.zeros(rows, bool)
            active[:batch.num_rows] = ~tracker.done
            if not multi:       # one round per dispatch: the host streams every round
                state, *out = self.round(states, state, active, limits, sp, base_key, np.int32(rounds + 1), knobs,
                                         greedy=greedy)
                tokens_bn, acc_b, from_mtp_b = to_host(tuple(out))
                out = (tokens_bn[:, None], acc_b[:, None], from_mtp_b[:, None], active[:, None], 1)
            else:               # up to K rounds per call, stopping on device
                state, *out = self.multi_round(states, state, active, limits, sp, base_key, np.int32(rounds + 1),
                                               stop_ids_s, knobs, greedy=greedy)
                out = list(to_host(tuple(out)))
                out[-1] = int(out[-1])
            feed_rounds(tracker, acceptance, first_source, *out, on_tokens, commit_cap=int(knobs.commit_cap))
            rounds += out[-1]
        decode_s = time.perf_counter() - t1
        self.last_state = state
        new_tokens = sum(len(o) for o in tracker.outputs)
        name = self.method
        if name == "dflash" and self.drafter.cfg.version == 2:
            name = "dflash2"
        stats = {
            "method": name, "ttft_s": ttft, "decode_s": decode_s, "target_forwards": rounds + 1,
            "new_tokens": new_tokens,
            "decode_tokens_per_s": (new_tokens - batch.num_rows) / decode_s if decode_s > 0 else 0.0,
            "batch_bucket": rows, "max_len": batch.max_len, "block_size": self.slots,
            "rounds_per_dispatch": self.rounds_per_dispatch,
            "draft_head": head_name(None if self.draft_head is None else self.draft_head.cfg),
            "acceptance_lengths": acceptance,
            "exactness_probe": gate.summary(),
            **acceptance_stats(acceptance, self.slots),
        }
        if self.proposer.ADAPTIVE:
            stats["adaptive_threshold"] = check_adaptive_threshold(self.adaptive_threshold)
            stats["t1_from_mtp"] = first_source
            stats.update(first_candidate_by_source(acceptance, first_source))
        return GenerationResult([list(map(int, p)) for p in prompts], tracker.outputs, stats)

    def compile_counts(self) -> dict[str, int]:
        """How many programs each jitted entry point compiled (one per shape bucket and greedy flag)."""
        counts = {"prefill": self.prefill_step.compiles, "round": self.round.compiles}
        if self.rounds_per_dispatch > 1:
            counts["multi_round"] = self.multi_round.compiles
        return counts
