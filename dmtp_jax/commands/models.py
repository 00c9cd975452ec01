"""Which models a command runs: the target (`--target`, else the shipped demo, else the built-in
tiny checkpoint), each method's drafter (the demo's own per method), the default method, and the
decoders built from them."""

from __future__ import annotations

import dataclasses
import os
import tempfile

from dmtp_jax.cli import model_sources
from dmtp_jax.options import DraftHeadOptions

DEMO_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "demo")
DEMO_OUT = os.path.join(tempfile.gettempdir(), "dmtp-jax-demo")
DEMO_METHODS = "ar,mtp,dflash,dmtp,dmtp-adaptive,eagle3,lookup,auto"
DEMO_WEAK_METHODS = "mtp,dmtp,dmtp-adaptive"     # the second table: the same methods with the corpus-only head
DEMO_CORPUS_HEAD = os.path.join(DEMO_DIR, "mtp_corpus")
DEMO_EAGLE3 = os.path.join(DEMO_DIR, "eagle3")


def demo_available() -> bool:
    """Whether the shipped demo (`demo/target` with its weights) is present."""
    return os.path.isfile(os.path.join(DEMO_DIR, "target", "model.safetensors"))


def uses_demo(args) -> bool:
    """No `--target` given and the demo is present: the demo's drafters are the defaults."""
    return not args.target and demo_available()


def resolve_target(path: str | None) -> str:
    """`path`, else the shipped demo target, else the built-in tiny random checkpoint.

    Example:
        >>> resolve_target("/models/x")
        '/models/x'
    """
    if path:
        return path
    if demo_available():
        return os.path.join(DEMO_DIR, "target")
    from dmtp_jax.tiny import ensure_tiny_target
    return ensure_tiny_target()


def default_method(args) -> str:
    """The one default method of a model (generate, bench with --draft, serve): the drafter
    directory's own method with `--draft` (`dmtp_config.method`, else dflash: a plain DFlash
    directory), dmtp on the demo, else ar.

    Example:
        >>> from types import SimpleNamespace as Args
        >>> default_method(Args(draft=None, target="/models/x"))
        'ar'
    """
    from dmtp_jax.config import read_config_json
    from dmtp_jax.preflight import draft_is_target
    if args.draft:
        try:
            config = read_config_json(args.draft)
            if draft_is_target(args.draft):
                return "draft-model"
        except Exception:       # noqa: BLE001 -- a missing / bad directory is preflight's error to report
            config = {}
        if "LlamaForCausalLMEagle3" in (config.get("architectures") or []):
            return "eagle3"
        return (config.get("dmtp_config") or {}).get("method") or "dflash"
    if getattr(args, "eagle3", None):
        return "eagle3"
    return "dmtp" if uses_demo(args) else "ar"


def eagle3_source(args) -> str | None:
    """The EAGLE-3 drafter directory: `--eagle3`, else the demo's `demo/eagle3` when the demo is in
    use without `--draft` (and ships one), else None.

    Example:
        >>> from types import SimpleNamespace as Args
        >>> eagle3_source(Args(eagle3="runs/e3", draft=None, target=None))
        'runs/e3'
    """
    given = getattr(args, "eagle3", None)
    if given or args.draft or not uses_demo(args) or not os.path.isdir(DEMO_EAGLE3):
        return given
    return DEMO_EAGLE3


def demo_drafter(method: str, mtp_dir: str | None = None) -> str | None:
    """The demo drafter of a method: `demo/dflash`, `demo/dmtp`, `demo/dmtp_adaptive`,
    `demo/eagle3`; the DMTP drafters trained against the corpus-only head (`demo/*_corpus`) when
    `mtp_dir` is that head.

    Example:
        >>> os.path.basename(demo_drafter("dmtp")), demo_drafter("ar")
        ('dmtp', None)
        >>> os.path.basename(demo_drafter("dmtp-adaptive", DEMO_CORPUS_HEAD))
        'dmtp_adaptive_corpus'
    """
    from dmtp_jax.decode import method_needs
    from dmtp_jax.methods import EAGLE3
    if not method_needs(method)["drafter"]:
        return None
    if method == EAGLE3:
        return DEMO_EAGLE3
    if not method_needs(method)["fusion"]:
        return os.path.join(DEMO_DIR, "dflash")
    name = method.replace("-", "_") if method == "dmtp-adaptive" else "dmtp"
    corpus = mtp_dir is not None and os.path.abspath(mtp_dir) == os.path.abspath(DEMO_CORPUS_HEAD)
    return os.path.join(DEMO_DIR, name + ("_corpus" if corpus else ""))


def method_models(args, target, methods) -> dict:
    """`load_method_models`, with each method's demo drafter when the demo is in use and no
    `--draft` is given (so dflash and dmtp run their own drafters in one bench; one drafting head
    shared by all), and the demo's token counts (`demo/dmtp/token_counts.npy`) unless
    `--draft-head-counts` is given."""
    from dmtp_jax.decode.loading import load_draft_head, load_method_models
    sources = model_sources(args)
    if args.draft or not uses_demo(args):
        return load_method_models(sources, target, methods)
    groups: dict = {}
    for m in methods:
        groups.setdefault(demo_drafter(m, args.mtp), []).append(m)
    # the demo drafters' token counts are one file's (same training data); mtp has no drafter directory
    counts = sources.draft_head.counts or os.path.join(DEMO_DIR, "dmtp")
    head = load_draft_head(dataclasses.replace(sources, draft_head=dataclasses.replace(sources.draft_head,
                                                                                       counts=counts)),
                           target, methods)
    out = {}
    for draft, group in groups.items():       # the drafting head is built once, above, for every group
        out.update(load_method_models(dataclasses.replace(sources, draft=draft, draft_head=DraftHeadOptions()),
                                      target, group))
    return {m: {**out[m], **({"draft_head": head} if head is not None and m != "ar" else {})} for m in methods}


def decoder_methods(args, target_dir: str, methods: list[str]) -> tuple[list[str], list[str]]:
    """`(every method a decoder is built for, auto's candidates)` for the requested `methods`: auto
    stands for every method the models allow; the models and block sizes of all of them checked
    once, before any load."""
    from dmtp_jax import preflight
    from dmtp_jax.decode.auto import AUTO
    demo = uses_demo(args)
    eagle3 = eagle3_source(args)
    candidates = preflight.auto_candidates(target_dir, args.draft, args.mtp, demo, eagle3) if AUTO in methods else []
    built = list(dict.fromkeys([*(m for m in methods if m != AUTO), *candidates]))
    preflight.check_method_models(built, target_dir, args.draft, args.mtp, demo_drafters=demo, eagle3=eagle3)
    preflight.check_drafter_block(built, args.draft, args.block_size, eagle3)
    preflight.check_drafter_method(built, args.draft)
    return built, candidates


def load_decoder(args, target_dir: str, method: str, methods: list[str], mesh, tokenizer):
    """`(decoder, stop token ids)` of `method` on the target, from generate's / serve's model flags;
    auto: an `AutoDecoder` over the decoders of `methods`."""
    from dmtp_jax.checkpoint.hf import load_target
    from dmtp_jax.decode.auto import AUTO, AutoDecoder
    from dmtp_jax.decode.loading import make_decoders
    from dmtp_jax.tokenizer import stop_token_ids

    target = load_target(target_dir, args.dtype, mesh)
    stops = stop_token_ids(target_dir, target.cfg.eos_token_ids, tokenizer)
    stops = sorted(set(stops) | set(getattr(args, "stop_token_ids", None) or []))
    decoders = make_decoders(methods, target, method_models(args, target, methods), block_size=args.block_size,
                             verify=args.verify, mtp_steps=args.mtp_steps, strict=args.strict,
                             rounds_per_dispatch=args.rounds_per_dispatch, prefill_chunk=args.prefill_chunk,
                             adaptive_threshold=args.adaptive_threshold)
    return (AutoDecoder(decoders) if method == AUTO else decoders[method]), stops
