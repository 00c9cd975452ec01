"""Decoding: plain (`ar`) and speculative methods behind one factory.

Example:
    >>> dec = make_decoder("dflash", target, drafter=drafter)  # doctest: +SKIP
    >>> dec.generate([[1, 2, 3]], max_new_tokens=16).stats["per_verify_acceptance_length"]  # doctest: +SKIP
"""

import numpy as np

from dmtp_jax.models.fusion import DMTP_METHODS

METHODS = ("ar", "mtp", "dflash") + tuple(DMTP_METHODS)


def method_needs(method: str) -> dict[str, bool]:
    """Which models a method uses: `{"drafter", "mtp", "fusion"}`.

    Example:
        >>> method_needs("dmtp")
        {'drafter': True, 'mtp': True, 'fusion': True}
    """
    return {"drafter": method == "dflash" or method in DMTP_METHODS,
            "mtp": method == "mtp" or method in DMTP_METHODS,
            "fusion": method in DMTP_METHODS}


def make_decoder(method: str, target, drafter=None, *, mtp=None, fusion=None, block_size: int | None = None,
                 mtp_steps: int = 4, verify: str = "rejection", strict: bool = False,
                 adaptive_threshold: float | None = None, rounds_per_dispatch: int = 1,
                 prefill_chunk: int | None = None):
    """The decoder for `method` in `METHODS`; every decoder has `.generate(...)` -> GenerationResult
    and `.compile_counts()`. `drafter` is a `LoadedDrafter` (dflash, dmtp*), `mtp` the native MTP
    head (`checkpoint.mtp_ckpt.load_mtp`; mtp, dmtp*), `fusion` the DMTP fusion
    (`checkpoint.dmtp_ckpt.load_dmtp_drafter`; dmtp*). `mtp_steps` is the chain length of `mtp`
    (MTP415 = 4 steps, 5 verify slots). `verify` is the sampled verifier: "rejection" (token-level),
    "block" (block verification, `decode/verify.py:verify_block`) or "target-only"; greedy decoding
    is always exact match. `adaptive_threshold` overrides dmtp-adaptive's calibrated MTP-confidence
    threshold. A speculative decoder runs the exactness probe
    (`decode/probe.py`) before its first request and falls back to plain decoding when a verify
    block differs from single-token decoding; `strict=True` raises `InexactBackendError` instead.
    `rounds_per_dispatch` K > 1 runs up to K speculative rounds per jitted call, stopping rows on
    device (`decode/multi_round.py`); the same outputs, streamed once per K rounds (`ar` ignores it).
    `prefill_chunk` (default `decode.prefill.DEFAULT_PREFILL_CHUNK`): prompts longer than this many
    tokens are prefilled in chunks of it, bounding the prefill's activations (`decode/prefill.py`)."""
    from dmtp_jax.decode.batch import RequestError
    from dmtp_jax.decode.prefill import DEFAULT_PREFILL_CHUNK

    prefill_chunk = DEFAULT_PREFILL_CHUNK if prefill_chunk is None else prefill_chunk
    if isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, (int, np.integer)) or prefill_chunk < 1:
        raise RequestError(f"--prefill-chunk must be an integer >= 1, got {prefill_chunk!r}")
    if method == "ar":
        from dmtp_jax.decode.ar import ARDecoder
        return ARDecoder(target, prefill_chunk=prefill_chunk)
    if method not in METHODS:
        raise RequestError(f"unknown method '{method}'; available: {', '.join(METHODS)}")
    from dmtp_jax.decode.spec import SpecDecoder
    return SpecDecoder(target, drafter, method=method, mtp=mtp, fusion=fusion, block_size=block_size,
                       mtp_steps=mtp_steps, verify=verify, strict=strict, adaptive_threshold=adaptive_threshold,
                       rounds_per_dispatch=rounds_per_dispatch, prefill_chunk=prefill_chunk)
