"""Cheap checks of a command line before any model is loaded (configs and tensor names read, no
weights), with the messages the loaders and decoders would give later (`dmtp_jax.options`)."""

from __future__ import annotations

import os
import sys

from dmtp_jax import options
from dmtp_jax.checkpoint.dflash_ckpt import load_dflash_config
from dmtp_jax.checkpoint.draft_head_ckpt import HEAD_FACTOR, TOKEN_COUNTS, drafter_file
from dmtp_jax.checkpoint.mtp_ckpt import MissingMtpError, has_mtp
from dmtp_jax.config import load_target_config, read_config_json
from dmtp_jax.decode.batch import pad_prompts
from dmtp_jax.errors import InputError, RequestError
from dmtp_jax.checkpoint.eagle3_ckpt import eagle3_config
from dmtp_jax.decode.loading import eagle3_dir
from dmtp_jax.methods import EAGLE3
from dmtp_jax.models.eagle3 import check_fits_target
from dmtp_jax.plan.topology import parse_topology


def target_config(target_dir: str):
    """The target's validated `config.json` (no weights read); `ConfigError` for a missing directory,
    a missing config.json or a bad config.

    Example:
        >>> target_config("/does-not-exist")
        Traceback (most recent call last):
        ...
        dmtp_jax.errors.ConfigError: model directory not found: /does-not-exist
    """
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
            tcfg = target_config(target_dir)
            check_fits_target(eagle3_config(read_config_json(_eagle3_dir(draft, eagle3)), tcfg.num_hidden_layers), tcfg)
        if need["drafter"] and method != EAGLE3 and not draft and not demo_drafters:
            raise options.missing_model_error(method, "drafter")
        if need["draft_model"]:
            if not draft:
                raise options.missing_model_error(method, "draft_model")
            options.check_draft_vocab(target_config(target_dir).vocab_size, target_config(draft).vocab_size, draft)
    if any(n["mtp"] for n in needs):
        mtp_dir = mtp or target_dir
        if mtp and not os.path.isdir(mtp):
            raise InputError(f"MTP directory not found: {mtp}")
        if not has_mtp(mtp_dir):
            raise MissingMtpError(f"{mtp_dir} has no native MTP head (no 'mtp.*' tensors); the methods "
                                  "mtp / dmtp need a target that carries one, or --mtp DIR")


def check_drafter_method(methods, draft: str | None) -> None:
    """A `--draft` directory trained for another method than one asked: a DMTP drafter of another DMTP
    method is an `InputError` (its fusion does not load); a DMTP drafter run as dflash, or a plain
    DFlash drafter run as a DMTP method (a zero fusion), runs, with a warning on stderr: its drafts
    are rarely accepted (0.07 of first candidates on the demo).

    Example:
        >>> check_drafter_method(["ar", "lookup"], None)
    """
    if not draft or not os.path.isfile(os.path.join(draft, "config.json")):
        return
    config = read_config_json(draft)
    if "dflash_config" not in config:               # an EAGLE-3 or draft-model directory: its own checks
        return
    stored = (config.get("dmtp_config") or {}).get("method")
    for method in methods:
        need = options.method_needs(method)
        if not need["drafter"] or method == EAGLE3 or stored == method or not (need["fusion"] or stored):
            continue
        if need["fusion"] and stored:
            raise InputError(f"{draft} holds a '{stored}' drafter, not '{method}'", hint=f"use --method {stored}, "
                             f"or a drafter trained with `train.py --method {method}`")
        trained = f"a '{stored}' drafter (trained with its fusion)" if stored else "a plain DFlash drafter"
        print(f"warning: {draft} is {trained}; --method {method} will accept few of its drafts "
              f"(use --method {stored or 'dflash'})", file=sys.stderr)


def draft_is_target(draft: str) -> bool:
    """Whether `--draft` is a (smaller) target checkpoint for `draft-model`, not a DFlash / DMTP
    drafter: its config names a `*ForCausalLM` / `*ForConditionalGeneration` architecture."""
    archs = read_config_json(draft).get("architectures") or []
    return any(a.endswith(("ForCausalLM", "ForConditionalGeneration")) for a in archs)


def _eagle3_dir(draft: str | None, eagle3: str | None) -> str | None:
    """`--eagle3`, else a `--draft` directory holding an EAGLE-3 drafter (`decode.loading.eagle3_dir`)."""
    return eagle3_dir(options.ModelSources(draft=draft, eagle3=eagle3))


def auto_candidates(target_dir: str, draft: str | None, mtp: str | None, demo_drafters: bool = False,
                    eagle3: str | None = None) -> list[str]:
    """The methods `--method auto` chooses from, by the models given (configs and tensor names
    read, no weights): `ar`, `lookup`; `mtp` with an MTP head; with `--draft`, `draft-model` for a
    target checkpoint, else its DMTP method (with an MTP head) or `dflash`; the shipped demo's drafters
    give dflash, dmtp and dmtp-adaptive."""
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
        stored = (read_config_json(draft).get("dmtp_config") or {}).get("method")
        out += [stored] if stored and with_mtp else [] if stored else ["dflash"]
    elif demo_drafters:
        out += ["dflash"] + (["dmtp", "dmtp-adaptive"] if with_mtp else [])
    return out


def check_drafter_block(methods, draft: str | None, block_size: int | None, eagle3: str | None = None) -> None:
    """The verify slots of every drafter method are ones the decoder takes (`options.verify_slots`):
    `--block-size` when given, else the drafter's own `block_size` (its config is read, no weights)."""
    for method in methods:
        path = _eagle3_dir(draft, eagle3) if method == EAGLE3 else draft
        if options.method_needs(method)["drafter"] and (path or block_size is not None):
            drafter_block = None
            if block_size is None and method == EAGLE3:
                drafter_block = eagle3_config(read_config_json(path), 1).block_size
            elif block_size is None:
                drafter_block = load_dflash_config(draft).block_size
            options.verify_slots(method, mtp_steps=0, block_size=block_size, drafter_block_size=drafter_block)


def check_draft_head(sources: options.ModelSources, counts: bool = True) -> None:
    """The drafting head's options (`options.check_draft_head_options`) and, when `counts` (plan
    reads no file), its token counts or trained factor file, before the target is loaded."""
    head = sources.draft_head
    options.check_draft_head_options(head)
    if counts and (head.factor is not None or head.vocab is not None):
        if head.factor is not None:
            drafter_file(head.factor, HEAD_FACTOR)
        elif sources.token_counts:      # else the demo's drafter directories, each read when its models load
            drafter_file(sources.token_counts, TOKEN_COUNTS)


def check_prompts(prompts: list[list[int]], max_new_tokens: int, cfg) -> None:
    """`RequestError` for an empty prompt, ids outside `[0, cfg.vocab_size)`, or prompt + budget past
    `cfg.max_position_embeddings`."""
    pad_prompts(prompts, max_new_tokens, cfg.vocab_size, cfg.max_position_embeddings)


def check_plan_options(*, target: str, draft: str | None, topology: str, batch_size: int, prompt_len: int,
                       max_new_tokens: int, mtp_steps: int, block_size: int | None, rounds_per_dispatch: int,
                       prefill_chunk: int | None = None, prefix_cache_gb: float = 0.0,
                       draft_head: options.DraftHeadOptions = options.DraftHeadOptions()) -> None:
    """`infer.py plan`: sizes and budgets in range, the target / drafter configs readable, and the
    request within the target's positions, before any compile (`RequestError`, `InputError`, `ConfigError`)."""
    parse_topology(topology)
    options.check_positive_int("--batch-size", batch_size, RequestError)
    options.check_positive_int("--prompt-len", prompt_len, RequestError)
    options.check_non_negative("--prefix-cache-gb", prefix_cache_gb, RequestError)
    check_decode_options(mtp_steps, block_size, max_new_tokens, rounds_per_dispatch, prefill_chunk=prefill_chunk)
    options.check_draft_head_options(draft_head)
    cfg = target_config(target)
    if draft:
        read_config_json(draft)
    if prompt_len + max_new_tokens > cfg.max_position_embeddings:
        raise RequestError(f"--prompt-len ({prompt_len}) + --max-new-tokens ({max_new_tokens}) exceeds "
                           f"the target's max_position_embeddings ({cfg.max_position_embeddings})")
