"""Loading the models a decoding method needs, from `options.ModelSources` (`generate`, `bench`,
`serve`).

Example:
    >>> models = load_method_models(ModelSources(draft="runs/dmtp"), target, ["ar", "dmtp"])  # doctest: +SKIP
    >>> decoders = make_decoders(["ar", "dmtp"], target, models, block_size=None)  # doctest: +SKIP
"""

from __future__ import annotations

from dmtp_jax.checkpoint.dflash_ckpt import load_drafter
from dmtp_jax.checkpoint.dmtp_ckpt import load_dmtp_drafter
from dmtp_jax.checkpoint.draft_head_ckpt import make_draft_head, read_head_factor, read_token_counts
from dmtp_jax.checkpoint.mtp_ckpt import load_mtp
from dmtp_jax.decode import make_decoder, method_needs
from dmtp_jax.options import ModelSources


def _load_drafter(sources: ModelSources, target, method):
    if not sources.draft:
        return None             # the factory then says which method needs --draft
    return load_drafter(sources.draft, target.cfg, sources.dtype, target.mesh)


def _load_mtp(sources: ModelSources, target, method):
    return load_mtp(sources.mtp or target.model_dir, target.cfg, sources.dtype, target.mesh)


def _load_fusion(sources: ModelSources, target, method):
    if not sources.draft:
        return None
    return load_dmtp_drafter(sources.draft, target.cfg, method, sources.dtype, target.mesh)[1]


# make_decoder keyword -> (loader(sources, target, method) -> model or None, one model per method?).
# Only the kinds `method_needs(method)` asks for are loaded. A new model kind is one line here.
MODEL_LOADERS = {
    "drafter": (_load_drafter, False),
    "mtp": (_load_mtp, False),          # native MTP head: --mtp DIR, else the target directory
    "fusion": (_load_fusion, True),     # DMTP fusion of --draft (zero fusion for a plain DFlash dir)
}


def load_method_models(sources: ModelSources, target, methods) -> dict[str, dict]:
    """`{method: {make_decoder keyword: model}}`: the models each method needs (`method_needs`),
    loaded once and shared between methods, and the drafting head of `sources.draft_head`
    (`load_draft_head`) for every speculative method. A model kind with no path given is left out,
    so the factory raises its own one-line error for the method that needs it.

    Example:
        >>> load_method_models(ModelSources(draft="d"), target, ["ar", "dflash"])  # doctest: +SKIP
        {'ar': {}, 'dflash': {'drafter': LoadedDrafter(...)}}
    """
    loaded: dict = {}
    out = {}
    head = load_draft_head(sources, target, methods)
    for method in methods:
        needs = method_needs(method)
        out[method] = {} if head is None or method == "ar" else {"draft_head": head}
        for kind, (loader, per_method) in MODEL_LOADERS.items():
            if not needs.get(kind):
                continue
            key = (kind, method if per_method else None)
            if key not in loaded:
                loaded[key] = loader(sources, target, method)
            if loaded[key] is not None:
                out[method][kind] = loaded[key]
    return out


def load_draft_head(sources: ModelSources, target, methods):
    """The drafting head `sources.draft_head` asks for (a `LoadedModel`,
    `checkpoint/draft_head_ckpt.py:make_draft_head`: the efficient one with the token counts at
    `sources.token_counts` or its trained factor), or None for the full head or when only `ar` runs.

    Example:
        >>> load_draft_head(ModelSources(draft_head=DraftHeadOptions("int8")), target, ["dmtp"]).cfg  # doctest: +SKIP
        {'kind': 'int8'}
    """
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
    `rounds_per_dispatch`, `prefill_chunk`, `adaptive_threshold`); None options are left out.

    Example:
        >>> make_decoders(["ar"], target, {})  # doctest: +SKIP
        {'ar': <dmtp_jax.decode.ar.ARDecoder ...>}
    """
    options = {k: v for k, v in options.items() if v is not None}
    return {m: make_decoder(m, target, **models.get(m, {}), **options) for m in methods}
