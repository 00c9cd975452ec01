"""Loading the models a decoding method needs, from `options.ModelSources` (`generate`, `bench`,
`serve`): `load_method_models`, then `make_decoders`."""

from __future__ import annotations

from dmtp_jax.checkpoint.dflash_ckpt import load_drafter
from dmtp_jax.checkpoint.dmtp_ckpt import load_dmtp_drafter
from dmtp_jax.checkpoint.draft_head_ckpt import make_draft_head, read_head_factor, read_token_counts
from dmtp_jax.checkpoint.eagle3_ckpt import is_eagle3_dir, load_eagle3
from dmtp_jax.checkpoint.hf import load_target
from dmtp_jax.checkpoint.mtp_ckpt import load_mtp
from dmtp_jax.decode import make_decoder, method_needs
from dmtp_jax.methods import EAGLE3
from dmtp_jax.options import ModelSources


def eagle3_dir(sources: ModelSources) -> str | None:
    """The EAGLE-3 drafter directory: `sources.eagle3`, else a `sources.draft` directory whose config
    names `LlamaForCausalLMEagle3`, else None.

    Example:
        >>> eagle3_dir(ModelSources(eagle3="runs/e3"))
        'runs/e3'
    """
    draft = sources.draft
    return sources.eagle3 or (draft if draft and is_eagle3_dir(draft) else None)


def _load_drafter(sources: ModelSources, target, method):
    if method == EAGLE3:
        path = eagle3_dir(sources)
        if not path:
            return None         # the factory then says that eagle3 needs --eagle3
        return load_eagle3(path, target.cfg, sources.dtype, target.mesh)
    if not sources.draft:
        return None             # the factory then says which method needs --draft
    return load_drafter(sources.draft, target.cfg, sources.dtype, target.mesh)


def _load_mtp(sources: ModelSources, target, method):
    return load_mtp(sources.mtp or target.model_dir, target.cfg, sources.dtype, target.mesh)


def _load_fusion(sources: ModelSources, target, method):
    if not sources.draft:
        return None
    return load_dmtp_drafter(sources.draft, target.cfg, method, sources.dtype, target.mesh)[1]


def _load_draft_model(sources: ModelSources, target, method):
    if not sources.draft:
        return None
    return load_target(sources.draft, sources.dtype, target.mesh)


# make_decoder keyword -> (loader(sources, target, method) -> model or None, which methods share one:
# method -> key). Only the kinds `method_needs(method)` asks for are loaded. A new model kind is one line here.
MODEL_LOADERS = {
    "drafter": (_load_drafter, lambda m: m == EAGLE3),  # --draft's DFlash drafter; eagle3: --eagle3's
    "mtp": (_load_mtp, lambda m: None),         # native MTP head: --mtp DIR, else the target directory
    "fusion": (_load_fusion, lambda m: m),      # DMTP fusion of --draft (zero fusion for a plain DFlash dir)
    "draft_model": (_load_draft_model, lambda m: None),  # draft-model: --draft is a smaller target
}


def load_method_models(sources: ModelSources, target, methods) -> dict[str, dict]:
    """`{method: {make_decoder keyword: model}}`: the models each method needs (`method_needs`),
    loaded once and shared between methods, and the drafting head of `sources.draft_head`
    (`load_draft_head`) for every speculative method. A model kind with no path given is left out,
    so the factory raises its own one-line error for the method that needs it."""
    loaded: dict = {}
    out = {}
    head = load_draft_head(sources, target, methods)
    for method in methods:
        needs = method_needs(method)
        out[method] = {} if head is None or method == "ar" else {"draft_head": head}
        for kind, (loader, share) in MODEL_LOADERS.items():
            if not needs.get(kind):
                continue
            key = (kind, share(method))
            if key not in loaded:
                loaded[key] = loader(sources, target, method)
            if loaded[key] is not None:
                out[method][kind] = loaded[key]
    return out


def load_draft_head(sources: ModelSources, target, methods):
    """The drafting head `sources.draft_head` asks for (a `LoadedModel`,
    `checkpoint/draft_head_ckpt.py:make_draft_head`: the efficient one with the token counts at
    `sources.token_counts` or its trained factor), or None for the full head or when only `ar` runs."""
    head = sources.draft_head
    if head.kind == "full" or all(m == "ar" for m in methods):
        return None
    counts = factor = None
    if head.factor and head.kind == "efficient":
        factor = read_head_factor(head.factor)
    elif head.vocab and head.kind == "efficient":
        path = sources.token_counts             # None: `make_draft_head` says what is missing
        counts = None if path is None else read_token_counts(path, target.cfg.vocab_size)
    return make_draft_head(target, head.kind, head.rank, head.shortlist, counts, head.vocab, factor)


def make_decoders(methods, target, models: dict[str, dict], **options) -> dict:
    """`{method: decoder}` from `dmtp_jax.decode.make_decoder`, passing each method's models (from
    `load_method_models`) and the options (`block_size`, `verify`, `mtp_steps`, `strict`,
    `rounds_per_dispatch`, `prefill_chunk`, `adaptive_threshold`); None options are left out."""
    options = {k: v for k, v in options.items() if v is not None}
    return {m: make_decoder(m, target, **models.get(m, {}), **options) for m in methods}
