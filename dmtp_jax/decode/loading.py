"""Loading the models a decoding method needs, from CLI-style arguments (`generate` and `bench`).

Example:
    >>> models = load_method_models(args, target, ["ar", "dmtp"])  # doctest: +SKIP
    >>> decoders = make_decoders(["ar", "dmtp"], target, models, block_size=None)  # doctest: +SKIP
"""

from __future__ import annotations

from dmtp_jax.decode import method_needs
from dmtp_jax.methods import EAGLE3


def eagle3_dir(args) -> str | None:
    """The EAGLE-3 drafter directory of CLI-style arguments: `--eagle3`, else a `--draft` directory
    whose config names `LlamaForCausalLMEagle3`, else None.

    Example:
        >>> import argparse
        >>> eagle3_dir(argparse.Namespace(eagle3="runs/e3", draft=None))
        'runs/e3'
    """
    from dmtp_jax.checkpoint.eagle3_ckpt import is_eagle3_dir
    draft = getattr(args, "draft", None)
    return getattr(args, "eagle3", None) or (draft if draft and is_eagle3_dir(draft) else None)


def _load_drafter(args, target, method):
    if method == EAGLE3:
        path = eagle3_dir(args)
        if not path:
            return None         # the factory then says that eagle3 needs --eagle3
        from dmtp_jax.checkpoint.eagle3_ckpt import load_eagle3
        return load_eagle3(path, target.cfg, args.dtype, target.mesh)
    if not getattr(args, "draft", None):
        return None             # the factory then says which method needs --draft
    from dmtp_jax.checkpoint.dflash_ckpt import load_drafter
    return load_drafter(args.draft, target.cfg, args.dtype, target.mesh)


def _load_mtp(args, target, method):
    from dmtp_jax.checkpoint.mtp_ckpt import load_mtp
    return load_mtp(getattr(args, "mtp", None) or target.model_dir, target.cfg, args.dtype, target.mesh)


def _load_fusion(args, target, method):
    if not getattr(args, "draft", None):
        return None
    from dmtp_jax.checkpoint.dmtp_ckpt import load_dmtp_drafter
    return load_dmtp_drafter(args.draft, target.cfg, method, args.dtype, target.mesh)[1]


def _load_draft_model(args, target, method):
    if not getattr(args, "draft", None):
        return None
    from dmtp_jax.checkpoint.hf import load_target
    return load_target(args.draft, args.dtype, target.mesh)


# make_decoder keyword -> (loader(args, target, method) -> model or None, which methods share one:
# method -> key). Only the kinds `method_needs(method)` asks for are loaded. A new model kind is one line here.
MODEL_LOADERS = {
    "drafter": (_load_drafter, lambda m: m == EAGLE3),  # --draft's DFlash drafter; eagle3: --eagle3's
    "mtp": (_load_mtp, lambda m: None),         # native MTP head: --mtp DIR, else the target directory
    "fusion": (_load_fusion, lambda m: m),      # DMTP fusion of --draft (zero fusion for a plain DFlash dir)
    "draft_model": (_load_draft_model, lambda m: None),  # draft-model: --draft is a smaller target
}


def load_method_models(args, target, methods) -> dict[str, dict]:
    """`{method: {make_decoder keyword: model}}`: the models each method needs (per
    `dmtp_jax.decode.method_needs`), loaded once and shared between methods.

    `args` carries the paths (`draft`, ...) and `dtype`; the target carries its mesh. `args.draft_head`
    "efficient" or "int8": one drafting head (`checkpoint/draft_head_ckpt.py:make_draft_head`; the efficient
    one of `draft_head_rank` / `draft_head_shortlist` / `draft_head_vocab`, the last with the token
    counts of `token_counts_path`, or the trained factor at `draft_head_factor`) shared by every
    speculative method. A model kind
    with no path given is left out, so the factory raises its own one-line error for the method
    that needs it. Add a model kind with one line in `MODEL_LOADERS`.

    Example:
        >>> load_method_models(argparse.Namespace(draft="d", dtype="float32"), target, ["ar", "dflash"])
        ... # doctest: +SKIP
        {'ar': {}, 'dflash': {'drafter': LoadedDrafter(...)}}
    """
    loaded: dict = {}
    out = {}
    head = load_draft_head(args, target, methods)
    for method in methods:
        needs = method_needs(method)
        out[method] = {} if head is None or method == "ar" else {"draft_head": head}
        for kind, (loader, share) in MODEL_LOADERS.items():
            if not needs.get(kind):
                continue
            key = (kind, share(method))
            if key not in loaded:
                loaded[key] = loader(args, target, method)
            if loaded[key] is not None:
                out[method][kind] = loaded[key]
    return out


def load_draft_head(args, target, methods):
    """The drafting head `args.draft_head` asks for (a `LoadedModel`; see `load_method_models`),
    or None for the full head or when only `ar` runs.

    Example:
        >>> load_draft_head(argparse.Namespace(draft_head="int8"), target, ["dmtp"]).cfg  # doctest: +SKIP
        {'kind': 'int8'}
    """
    kind = getattr(args, "draft_head", "full")
    if kind == "full" or all(m == "ar" for m in methods):
        return None
    from dmtp_jax.checkpoint.draft_head_ckpt import make_draft_head
    subset = getattr(args, "draft_head_vocab", None)
    counts = factor = None
    if getattr(args, "draft_head_factor", None) and kind == "efficient":
        from dmtp_jax.checkpoint.draft_head_ckpt import read_head_factor
        factor = read_head_factor(args.draft_head_factor)
    elif subset and kind == "efficient":
        from dmtp_jax.checkpoint.draft_head_ckpt import read_token_counts
        path = token_counts_path(args)          # None: `make_draft_head` says what is missing
        counts = None if path is None else read_token_counts(path, target.cfg.vocab_size)
    return make_draft_head(target, kind, getattr(args, "draft_head_rank", None),
                           getattr(args, "draft_head_shortlist", None), counts, subset, factor)


def token_counts_path(args) -> str | None:
    """Where `--draft-head-vocab` reads its token counts: `--draft-head-counts`, else the drafter
    directory (`--draft`, its `token_counts.npy`); None when neither is given.

    Example:
        >>> import argparse
        >>> token_counts_path(argparse.Namespace(draft_head_counts=None, draft="runs/drafter"))
        'runs/drafter'
    """
    return getattr(args, "draft_head_counts", None) or getattr(args, "draft", None)


def make_decoders(methods, target, models: dict[str, dict], **options) -> dict:
    """`{method: decoder}` from `dmtp_jax.decode.make_decoder`, passing each method's models (from
    `load_method_models`) and the options (`block_size`, `verify`, `mtp_steps`, `strict`,
    `rounds_per_dispatch`, `prefill_chunk`); None options are left out. Unknown methods and missing models raise the
    factory's one-line errors.

    Example:
        >>> make_decoders(["ar"], target, {})  # doctest: +SKIP
        {'ar': <dmtp_jax.decode.ar.ARDecoder ...>}
    """
    from dmtp_jax.decode import make_decoder

    options = {k: v for k, v in options.items() if v is not None}
    return {m: make_decoder(m, target, **models.get(m, {}), **options) for m in methods}
