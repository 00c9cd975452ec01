"""Cheap checks of a command line, run before any model is loaded: a bad input costs milliseconds
(not a model load) and is reported before anything is written to stdout.

Each check raises one of our error types (`dmtp_jax.errors`), with the same message the loaders or
decoders would give later: option ranges and "which models a method needs" are `dmtp_jax.options`,
the very functions the decoders and the trainer call.

Example:
    >>> check_decode_options(mtp_steps=4, block_size=None, max_new_tokens=16)
    >>> check_decode_options(mtp_steps=0, block_size=None, max_new_tokens=16)
    Traceback (most recent call last):
    ...
    dmtp_jax.errors.RequestError: --mtp-steps must be in [1, 15], got 0
"""

from __future__ import annotations

import os

from dmtp_jax import options
from dmtp_jax.decode.batch import pad_prompts
from dmtp_jax.errors import InputError, RequestError
from dmtp_jax.methods import EAGLE3


def target_config(target_dir: str):
    """The target's validated `config.json` (no weights read): "model directory not found",
    "no config.json" and bad configs end here.

    Example:
        >>> target_config("/does-not-exist")
        Traceback (most recent call last):
        ...
        dmtp_jax.errors.ConfigError: model directory not found: /does-not-exist
    """
    from dmtp_jax.config import load_target_config
    return load_target_config(target_dir)


def check_decode_options(mtp_steps: int | None, block_size: int | None, max_new_tokens: int,
                         rounds_per_dispatch: int | None = None, adaptive_threshold: float | None = None,
                         prefill_chunk: int | None = None) -> None:
    """Ranges of `--mtp-steps`, `--block-size`, `--max-new-tokens`, `--rounds-per-dispatch`,
    `--adaptive-threshold` and `--prefill-chunk`: `options.check_decode_options`, as the decoders
    check them (None: not given)."""
    options.check_decode_options(mtp_steps=mtp_steps, block_size=block_size, max_new_tokens=max_new_tokens,
                                 rounds_per_dispatch=rounds_per_dispatch, adaptive_threshold=adaptive_threshold,
                                 prefill_chunk=prefill_chunk)


def check_method_models(methods, target_dir: str, draft: str | None, mtp: str | None,
                        demo_drafters: bool = False, eagle3: str | None = None) -> None:
    """Every model directory the methods need exists (and an MTP head is in the safetensors); a
    draft model (`--method draft-model --draft DIR`) is a target config of the target's vocabulary.

    `demo_drafters`: the shipped demo supplies the drafters when `--draft` is not given.

    Example:
        >>> check_method_models(["ar"], "/models/x", None, None)
        >>> check_method_models(["dflash"], "/models/x", None, None)
        Traceback (most recent call last):
        ...
        dmtp_jax.errors.RequestError: method 'dflash' needs a DFlash drafter (--draft DIR)
    """
    needs = [options.method_needs(m) for m in methods]
    for path in (draft, eagle3):
        if path and not os.path.isdir(path):
            raise InputError(f"drafter directory not found: {path}")
        if path and not os.path.isfile(os.path.join(path, "config.json")):
            raise InputError(f"no config.json in the drafter directory {path}")
    for method, need in zip(methods, needs):
        if method == EAGLE3 and not _eagle3_dir(draft, eagle3):
            raise options.missing_model_error(method, "drafter")
        if method == EAGLE3:        # hidden size, vocabulary and taps against the target's config
            from dmtp_jax.checkpoint.eagle3_ckpt import eagle3_config
            from dmtp_jax.config import read_config_json
            from dmtp_jax.models.eagle3 import check_fits_target
            tcfg = target_config(target_dir)
            check_fits_target(eagle3_config(read_config_json(_eagle3_dir(draft, eagle3)), tcfg.num_hidden_layers), tcfg)
        if need["drafter"] and method != EAGLE3 and not draft and not demo_drafters:
            raise options.missing_model_error(method, "drafter")
        if need["draft_model"]:
            if not draft:
                raise options.missing_model_error(method, "draft_model")
            options.check_draft_vocab(target_config(target_dir).vocab_size, target_config(draft).vocab_size, draft)
    if any(n["mtp"] for n in needs):
        from dmtp_jax.checkpoint.mtp_ckpt import MissingMtpError, has_mtp
        mtp_dir = mtp or target_dir
        if mtp and not os.path.isdir(mtp):
            raise InputError(f"MTP directory not found: {mtp}")
        if not has_mtp(mtp_dir):
            raise MissingMtpError(f"{mtp_dir} has no native MTP head (no 'mtp.*' tensors); the methods "
                                  "mtp / dmtp need a target that carries one, or --mtp DIR")


def draft_is_target(draft: str) -> bool:
    """`--draft` is a (smaller) target checkpoint for `draft-model`, not a DFlash / DMTP drafter: its
    config names a causal-LM architecture (`*ForCausalLM`, `*ForConditionalGeneration`).

    Example:
        >>> draft_is_target("/models/Qwen3-0.6B")  # doctest: +SKIP
        True
    """
    from dmtp_jax.config import read_config_json
    archs = read_config_json(draft).get("architectures") or []
    return any(a.endswith(("ForCausalLM", "ForConditionalGeneration")) for a in archs)


def _eagle3_dir(draft: str | None, eagle3: str | None) -> str | None:
    """`--eagle3`, else a `--draft` directory holding an EAGLE-3 drafter (`decode.loading.eagle3_dir`)."""
    from dmtp_jax.checkpoint.eagle3_ckpt import is_eagle3_dir
    return eagle3 or (draft if draft and is_eagle3_dir(draft) else None)


def auto_candidates(target_dir: str, draft: str | None, mtp: str | None, demo_drafters: bool = False,
                    eagle3: str | None = None) -> list[str]:
    """The methods `--method auto` chooses from, by the models given (configs and tensor names
    read, no weights): `ar`, `lookup` (it needs no model); `mtp` when the target (or `--mtp`) carries
    an MTP head; with `--draft`, `draft-model` when it is a target checkpoint (`draft_is_target`),
    else the DMTP method its `dmtp_config` names (when there is an MTP head), else `dflash`; the
    shipped demo's drafters give dflash, dmtp and dmtp-adaptive.

    Example:
        >>> auto_candidates("/models/no-mtp", None, None)  # doctest: +SKIP
        ['ar']
    """
    from dmtp_jax.checkpoint.mtp_ckpt import has_mtp
    check_method_models([], target_dir, draft, mtp, eagle3=eagle3)
    if mtp and not os.path.isdir(mtp):
        raise InputError(f"MTP directory not found: {mtp}")
    with_mtp = has_mtp(mtp or target_dir)
    out = ["ar", "lookup"] + (["mtp"] if with_mtp else []) + ([EAGLE3] if _eagle3_dir(draft, eagle3) else [])
    if draft and draft == _eagle3_dir(draft, None):
        pass                    # an EAGLE-3 directory given as --draft: eagle3 only
    elif draft and draft_is_target(draft):
        out += ["draft-model"]
    elif draft:
        from dmtp_jax.config import read_config_json
        stored = (read_config_json(draft).get("dmtp_config") or {}).get("method")
        out += [stored] if stored and with_mtp else [] if stored else ["dflash"]
    elif demo_drafters:
        out += ["dflash"] + (["dmtp", "dmtp-adaptive"] if with_mtp else [])
    return out


def check_drafter_block(methods, draft: str | None, block_size: int | None, eagle3: str | None = None) -> None:
    """The verify slots of every drafter method are ones the decoder takes (`options.verify_slots`):
    `--block-size` when given, else the drafter's own `block_size` (its config is read, no weights).

    Example:
        >>> check_drafter_block(["ar", "mtp"], None, None)
        >>> check_drafter_block(["dflash"], "/models/d", 2)
        Traceback (most recent call last):
        ...
        dmtp_jax.errors.RequestError: --block-size must be in [3, 64], got 2
    """
    for method in methods:
        path = _eagle3_dir(draft, eagle3) if method == EAGLE3 else draft
        if options.method_needs(method)["drafter"] and (path or block_size is not None):
            drafter_block = None
            if block_size is None and method == EAGLE3:
                from dmtp_jax.checkpoint.eagle3_ckpt import eagle3_config
                from dmtp_jax.config import read_config_json
                drafter_block = eagle3_config(read_config_json(path), 1).block_size
            elif block_size is None:
                from dmtp_jax.checkpoint.dflash_ckpt import load_dflash_config
                drafter_block = load_dflash_config(draft).block_size
            options.verify_slots(method, mtp_steps=0, block_size=block_size, drafter_block_size=drafter_block)


def check_draft_head(args, counts: bool = True) -> None:
    """`--draft-head efficient`'s rank, shortlist and vocabulary subset are >= 1
    (`models/draft_head.head_shape`) and, when `counts` (plan needs none), the subset's token counts
    or the trained factor are there, before the target is loaded.

    Example:
        >>> import argparse
        >>> check_draft_head(argparse.Namespace(draft_head="efficient", draft_head_rank=0, draft_head_shortlist=None))
        Traceback (most recent call last):
        ...
        dmtp_jax.errors.InputError: --draft-head-rank must be >= 1, got 0
    """
    if getattr(args, "draft_head", "full") == "efficient":
        from dmtp_jax.models.draft_head import head_shape
        head_shape(1, 1, args.draft_head_rank, args.draft_head_shortlist)
    factor, vocab = getattr(args, "draft_head_factor", None), getattr(args, "draft_head_vocab", None)
    for flag, value in (("--draft-head-factor", factor), ("--draft-head-vocab", vocab)):
        if value is not None and getattr(args, "draft_head", "full") != "efficient":
            raise InputError(f"{flag} is an option of --draft-head efficient")
    if factor is None and vocab is not None and vocab < 1:
        raise InputError(f"--draft-head-vocab must be >= 1, got {vocab}")
    if counts and (factor is not None or vocab is not None):    # plan reads neither file
        from dmtp_jax.decode.loading import token_counts_path
        from dmtp_jax.checkpoint.draft_head_ckpt import HEAD_FACTOR, TOKEN_COUNTS, drafter_file
        if factor is not None:
            drafter_file(factor, HEAD_FACTOR)
        elif path := token_counts_path(args):   # else the demo's drafter directories, each read when its models load
            drafter_file(path, TOKEN_COUNTS)


def check_prompts(prompts: list[list[int]], max_new_tokens: int, cfg) -> None:
    """Empty prompts, ids outside the vocabulary, prompt + budget past `max_position_embeddings`.

    Example:
        >>> check_prompts([[1, 500]], 4, cfg)  # doctest: +SKIP
        RequestError: prompt 0 has token ids outside the vocabulary [0, 128): [500]
    """
    pad_prompts(prompts, max_new_tokens, cfg.vocab_size, cfg.max_position_embeddings)


def check_plan_options(args) -> None:
    """`infer.py plan`: sizes and budgets in range, the target / drafter configs readable, and the
    request within the target's positions, before any compile.

    Example:
        >>> import argparse
        >>> check_plan_options(argparse.Namespace(target="/nope.json", draft=None, batch_size=1, topology="cpu:1",
        ...     prompt_len=8, max_new_tokens=8, mtp_steps=4, block_size=None, rounds_per_dispatch=1))
        Traceback (most recent call last):
        ...
        dmtp_jax.errors.ConfigError: model directory not found: /nope.json
    """
    from dmtp_jax.plan.topology import parse_topology
    parse_topology(args.topology)
    if args.batch_size < 1:
        raise RequestError(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.prompt_len < 1:
        raise RequestError(f"--prompt-len must be >= 1, got {args.prompt_len}")
    if not getattr(args, "prefix_cache_gb", 0.0) >= 0:
        raise RequestError(f"--prefix-cache-gb must be >= 0, got {args.prefix_cache_gb}")
    check_decode_options(args.mtp_steps, args.block_size, args.max_new_tokens, args.rounds_per_dispatch,
                         prefill_chunk=getattr(args, "prefill_chunk", None))
    check_draft_head(args, counts=False)
    cfg = target_config(args.target)
    if args.draft:
        from dmtp_jax.config import read_config_json
        read_config_json(args.draft)
    if args.prompt_len + args.max_new_tokens > cfg.max_position_embeddings:
        raise RequestError(f"--prompt-len ({args.prompt_len}) + --max-new-tokens ({args.max_new_tokens}) exceeds "
                           f"the target's max_position_embeddings ({cfg.max_position_embeddings})")
