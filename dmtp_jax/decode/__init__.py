"""Decoding: plain (`ar`) and speculative methods behind one factory.

Example:
    >>> dec = make_decoder("dflash", target, drafter=drafter)  # doctest: +SKIP
    >>> dec.generate([[1, 2, 3]], max_new_tokens=16).stats["per_verify_acceptance_length"]  # doctest: +SKIP
"""

from dmtp_jax.options import DECODE_METHODS as METHODS, check_decode_options, method_needs  # noqa: F401


def make_decoder(method: str, target, drafter=None, *, mtp=None, fusion=None, block_size: int | None = None,
                 mtp_steps: int = 4, verify: str = "rejection", strict: bool = False,
                 adaptive_threshold: float | None = None, rounds_per_dispatch: int = 1,
                 prefill_chunk: int | None = None, draft_head=None, draft_model=None):
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
    tokens are prefilled in chunks of it, bounding the prefill's activations (`decode/prefill.py`).
    `draft_head`: the drafting side's efficient or int8 LM head (`checkpoint/draft_head_ckpt.py:make_draft_head`;
    None: the full head; `ar` ignores it). `draft_model`: draft-model's smaller target of the same
    vocabulary (`checkpoint.hf.load_target`)."""
    from dmtp_jax.decode.prefill import DEFAULT_PREFILL_CHUNK

    prefill_chunk = DEFAULT_PREFILL_CHUNK if prefill_chunk is None else prefill_chunk
    # the options' ranges, as preflight checks them (`dmtp_jax/options.py`); the decoders check
    # what depends on the loaded models (`options.check_models_given`, `options.verify_slots`)
    check_decode_options(method=method, rounds_per_dispatch=rounds_per_dispatch, prefill_chunk=prefill_chunk,
                         adaptive_threshold=adaptive_threshold, verify=verify,
                         mtp_steps=mtp_steps, block_size=block_size)
    if method == "ar":
        from dmtp_jax.decode.ar import ARDecoder
        return ARDecoder(target, prefill_chunk=prefill_chunk)
    from dmtp_jax.decode.spec import SpecDecoder
    return SpecDecoder(target, drafter, method=method, mtp=mtp, fusion=fusion, block_size=block_size,
                       mtp_steps=mtp_steps, verify=verify, strict=strict, adaptive_threshold=adaptive_threshold,
                       rounds_per_dispatch=rounds_per_dispatch, prefill_chunk=prefill_chunk, draft_head=draft_head,
                       draft_model=draft_model)
