"""Decoding: plain (`ar`) and speculative methods behind one factory, `make_decoder`."""

from dmtp_jax.options import DECODE_METHODS as METHODS, check_decode_options, method_needs  # noqa: F401
# the decoders after the names above: modules of this package import `method_needs` from it
from dmtp_jax.decode.ar import ARDecoder  # noqa: E402
from dmtp_jax.decode.prefill import DEFAULT_PREFILL_CHUNK  # noqa: E402
from dmtp_jax.decode.spec import SpecDecoder  # noqa: E402


def make_decoder(method: str, target, drafter=None, *, mtp=None, fusion=None, block_size: int | None = None,
                 mtp_steps: int = 4, verify: str = "rejection", strict: bool = False,
                 adaptive_threshold: float | None = None, rounds_per_dispatch: int = 1,
                 prefill_chunk: int | None = None, draft_head=None, draft_model=None):
    """The decoder for `method` in `METHODS`: `.generate(...) -> GenerationResult`, `.compile_counts()`.

    `drafter`: a `LoadedDrafter` (dflash, dmtp*); `mtp`: the native MTP head (mtp, dmtp*); `fusion`:
    the DMTP fusion (dmtp*); `mtp_steps`: `mtp`'s chain length; `verify`: the sampled verifier
    ("rejection", "block", "target-only"; greedy is exact match); `adaptive_threshold`: overrides
    dmtp-adaptive's calibrated threshold; `strict`: raise `InexactBackendError` when the exactness
    probe (`decode/probe.py`) finds the backend inexact instead of decoding plainly;
    `rounds_per_dispatch`, `prefill_chunk`, `draft_head`: see `SpecDecoder` (`ar` ignores the first
    and last); `draft_model`: draft-model's smaller target of the same vocabulary."""
    prefill_chunk = DEFAULT_PREFILL_CHUNK if prefill_chunk is None else prefill_chunk
    # the options' ranges, as preflight checks them (`dmtp_jax/options.py`); the decoders check
    # what depends on the loaded models (`options.check_models_given`, `options.verify_slots`)
    check_decode_options(method=method, rounds_per_dispatch=rounds_per_dispatch, prefill_chunk=prefill_chunk,
                         adaptive_threshold=adaptive_threshold, verify=verify,
                         mtp_steps=mtp_steps, block_size=block_size)
    if method == "ar":
        return ARDecoder(target, prefill_chunk=prefill_chunk)
    return SpecDecoder(target, drafter, method=method, mtp=mtp, fusion=fusion, block_size=block_size,
                       mtp_steps=mtp_steps, verify=verify, strict=strict, adaptive_threshold=adaptive_threshold,
                       rounds_per_dispatch=rounds_per_dispatch, prefill_chunk=prefill_chunk, draft_head=draft_head,
                       draft_model=draft_model)
