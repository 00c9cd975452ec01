"""The exactness probe: does a verify block give the same greedy tokens as single-token decoding
on the running backend and dtype? (In bfloat16 on an accelerator a near-tie can flip: see
docs/numerics.md.) Each speculative decoder owns an `ExactnessCheck`: before its first request it
decodes `width` tokens one at a time on `PROBE_INPUTS` random prompts and runs one verify forward
over them, memoized per (target, width); on a mismatch the decoder decodes plainly (`ar`), or
raises `InexactBackendError` when strict. The verdict is in `stats["exactness_probe"]`."""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import time
import weakref

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dmtp_jax.decode.batch import pad_prompts
from dmtp_jax.decode.caches import TargetCaches
from dmtp_jax.decode.prefill import DEFAULT_PREFILL_CHUNK
from dmtp_jax.decode.round import SpecState, verify_forward
from dmtp_jax.decode.sampling import SamplingParams
from dmtp_jax.errors import InexactBackendError
from dmtp_jax.decode.ar import ARDecoder, decode_step, prefill_step, run_prefill

log = logging.getLogger(__name__)
ALLOW_INEXACT_ENV = "DMTP_JAX_ALLOW_INEXACT"
PROBE_INPUTS = 3
PROBE_PROMPT_LEN = 8


@dataclasses.dataclass(frozen=True)
class ProbeResult:
    """The probe's verdict: `exact` when every block position matched the chain."""
    exact: bool
    width: int                   # block width checked (the decoder's verify slots)
    inputs: int                  # independent prompts
    prompt_len: int
    positions: int               # block positions compared (inputs * width)
    mismatches: int
    first_mismatch: tuple[int, int] | None     # (input, block position)
    backend: str
    dtype: str
    seconds: float

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["first_mismatch"] = list(self.first_mismatch) if self.first_mismatch else None
        return d


def probe_prompts(vocab_size: int, inputs: int = PROBE_INPUTS, prompt_len: int = PROBE_PROMPT_LEN,
                  seed: int = 0) -> list[list[int]]:
    """`inputs` random prompts of `prompt_len` token ids (fixed seed: the same on every run).

    Example:
        >>> [len(p) for p in probe_prompts(128, inputs=2, prompt_len=4)]
        [4, 4]
    """
    rng = np.random.default_rng(seed)
    return rng.integers(0, vocab_size, size=(inputs, prompt_len)).tolist()


def compare_block_to_chain(chain_rn: np.ndarray, block_argmax_rw: np.ndarray) -> tuple[int, tuple[int, int] | None]:
    """`(mismatches, first (row, position))`: block position j must predict chain token j + 1
    (`chain_rn`: `width + 1` greedy tokens per row; `block_argmax_rw`: the block's argmax).

    Example:
        >>> compare_block_to_chain(np.array([[5, 6, 7]]), np.array([[6, 9]]))
        (1, (0, 1))
    """
    width = block_argmax_rw.shape[1]
    wrong = np.asarray(block_argmax_rw) != np.asarray(chain_rn)[:, 1:width + 1]
    where = np.argwhere(wrong)
    return int(wrong.sum()), (tuple(int(i) for i in where[0]) if len(where) else None)


# The probe runs the decoders' own step functions, jitted here with the graphdef and mesh static so
# that probes of targets of one architecture share their compiles: the chain is plain decoding's
# prefill and single-token step (`decode/ar.py:prefill_step`, `decode_step`, as `ARDecoder` runs
# them), the block is the round's verify phase (`decode/round.py:verify_forward`).
_prefill_step = jax.jit(prefill_step, static_argnums=(0, 1), static_argnames=("greedy",))
_decode_step = jax.jit(decode_step, static_argnums=(0, 1), static_argnames=("greedy",))


@functools.partial(jax.jit, static_argnums=0)
def _verify_argmax(graphdef, state, lengths_b, block_bt, cache):
    """Argmax of the round's verify forward over `block` (pending token + drafts) from `cache`."""
    st = SpecState(cache, None, None, None, lengths_b, block_bt[:, 0])
    fwd = verify_forward(nnx.merge(graphdef, state), st, block_bt[:, 1:])
    return jnp.argmax(fwd.logits_bnv, axis=-1).astype(jnp.int32)


def chain_and_block(target, prompts: list[list[int]], width: int) -> tuple[np.ndarray, np.ndarray]:
    """`(chain [rows, width + 1], block argmax [rows, width])`: after one prefill of `prompts`, the
    greedy tokens of single-token decoding, and the argmax of ONE verify forward over the chain's
    first `width` tokens from the same prefilled cache."""
    cfg, graphdef, state, mesh = target.cfg, target.graphdef, target.state, target.mesh
    batch = pad_prompts(prompts, width + 1, cfg.vocab_size, cfg.max_position_embeddings, slack=width)
    rows = batch.tokens_bt.shape[0]
    sp, key = SamplingParams.make(), jax.random.key(0)
    prefill = functools.partial(_prefill_step, graphdef, mesh)
    first, prefilled = run_prefill(prefill, state, batch.tokens_bt, batch.lengths_b,
                                   TargetCaches(target).new(rows, batch.max_len), sp, key, True,
                                   DEFAULT_PREFILL_CHUNK, mesh)
    chain, cache = [first], prefilled
    for j in range(width):            # a fresh positions array per call: jit may alias numpy inputs
        nxt, cache = _decode_step(       # not donated: `prefilled` stays for the block
            graphdef, mesh, state, chain[-1], batch.lengths_b + np.int32(j), cache, sp, key,
                                  greedy=True)
        chain.append(nxt)
    chain_rn = np.stack([np.asarray(t) for t in chain], axis=1)
    block = _verify_argmax(graphdef, state, batch.lengths_b, chain_rn[:, :width], prefilled)
    return chain_rn[:len(prompts)], np.asarray(block)[:len(prompts)]


def run_probe(target, width: int, inputs: int = PROBE_INPUTS, prompt_len: int = PROBE_PROMPT_LEN,
              seed: int = 0) -> ProbeResult:
    """A `ProbeResult`: a `width`-token verify block against single-token decoding on `inputs` random
    prompts of `target`."""
    t0 = time.perf_counter()
    prompts = probe_prompts(target.cfg.vocab_size, inputs, prompt_len, seed)
    chain, argmax = chain_and_block(target, prompts, width)
    mismatches, first = compare_block_to_chain(chain, argmax)
    return ProbeResult(exact=mismatches == 0, width=width, inputs=inputs, prompt_len=prompt_len,
                       positions=inputs * width, mismatches=mismatches, first_mismatch=first,
                       backend=jax.default_backend(), dtype=str(np.dtype(target.state_dtype)),
                       seconds=time.perf_counter() - t0)


_MEMO: dict[tuple[int, int], tuple[weakref.ref, ProbeResult]] = {}
_WARNED: set[tuple[int, int]] = set()


def probe_target(target, width: int) -> ProbeResult:
    """`run_probe` once per (loaded target, width) in this process."""
    key = (id(target), width)
    hit = _MEMO.get(key)
    if hit is not None and hit[0]() is target:
        return hit[1]
    result = run_probe(target, width)
    _MEMO[key] = (weakref.ref(target), result)
    return result


def verdict_text(result: ProbeResult) -> str:
    """One line naming what differed, for the warning and the `--strict` error.

    Example:
        >>> r = ProbeResult(False, 8, 3, 8, 24, 2, (1, 5), "tpu", "bfloat16", 0.1)
        >>> verdict_text(r).split(" at ")[1]
        '2 of 24 positions (first: input 1, position 5) on tpu in bfloat16'
    """
    where = f" (first: input {result.first_mismatch[0]}, position {result.first_mismatch[1]})" \
        if result.first_mismatch else ""
    return (f"exactness probe: a {result.width}-token verify block differs from single-token decoding at "
            f"{result.mismatches} of {result.positions} positions{where} on {result.backend} in {result.dtype}")


@dataclasses.dataclass
class ExactnessGate:
    """A decoder's probe verdict and what follows from it: speculative decoding (`engaged`) or
    plain decoding with the same target."""
    probe: ProbeResult
    engaged: bool
    decision: str                # "speculative", "plain" or "speculative (inexact allowed)"
    target: object
    method: str = ""
    prefill_chunk: int | None = None     # the declining decoder's, for its plain decoder
    _plain: object = None

    def summary(self) -> dict:
        """The probe's result for `stats["exactness_probe"]`."""
        return {**self.probe.as_dict(), "decision": self.decision}

    def plain_generate(self, prompts, max_new_tokens, sampling=None, seed=0, stop_ids=None, on_tokens=None):
        """The request decoded with `ar`; its stats carry the probe and the `declined_method`."""
        if self._plain is None:
            self._plain = ARDecoder(self.target) if self.prefill_chunk is None else ARDecoder(
                self.target, prefill_chunk=self.prefill_chunk)
        result = self._plain.generate(prompts, max_new_tokens, sampling, seed, stop_ids, on_tokens)
        result.stats["exactness_probe"] = self.summary()
        result.stats["declined_method"] = self.method
        return result


def decide(probe: ProbeResult, strict: bool, allow_inexact: bool) -> tuple[bool, str]:
    """`(engaged, decision)` for a probe verdict; raises `InexactBackendError` when strict.

    Example:
        >>> ok = ProbeResult(True, 8, 3, 8, 24, 0, None, "cpu", "float32", 0.1)
        >>> decide(ok, strict=True, allow_inexact=False)
        (True, 'speculative')
    """
    if probe.exact:
        return True, "speculative"
    if strict:
        raise InexactBackendError(verdict_text(probe),
                                  hint="without --strict the request falls back to plain decoding; "
                                       "--dtype float32 usually makes the block exact")
    if allow_inexact:
        return True, "speculative (inexact allowed)"
    return False, "plain"


class ExactnessCheck:
    """A decoder's exactness gate, a field it makes at construction: `gate()` probes the target at
    `width` on first use (then memoized) and decides (`decide`; `strict` raises), warning once per
    (target, width) on a mismatch; `probed` says whether it has."""

    def __init__(self, target, width: int, *, strict: bool = False, method: str = "",
                 prefill_chunk: int | None = None):
        self.target, self.width, self.strict = target, width, strict
        self.method, self.prefill_chunk = method, prefill_chunk
        self._gate: ExactnessGate | None = None

    @property
    def probed(self) -> bool:
        return self._gate is not None

    def gate(self) -> ExactnessGate:
        if self._gate is not None:
            return self._gate
        probe = probe_target(self.target, self.width)
        engaged, decision = decide(probe, self.strict, os.environ.get(ALLOW_INEXACT_ENV, "") not in ("", "0"))
        key = (id(self.target), self.width)
        if not probe.exact and key not in _WARNED:
            _WARNED.add(key)
            action = (f"engaging anyway ({ALLOW_INEXACT_ENV})" if engaged
                      else "using plain decoding (pass --strict to fail instead)")
            log.warning("%s; %s", verdict_text(probe), action)
        self._gate = ExactnessGate(probe, engaged, decision, self.target, self.method, self.prefill_chunk)
        return self._gate
