"""Every decode, serve and training option, checked in one place: its range and its message (naming
the flag; decode options raise `RequestError`, training and CLI-only ones `InputError`), and which
models each method needs. The CLI, `preflight`, the decoders, the engine and the trainer call these
same functions. `DraftHeadOptions` and `ModelSources` are the CLI's model options as data.

Example:
    >>> check_decode_options(method="dmtp", block_size=8, mtp_steps=4, max_new_tokens=16)
    >>> check_block_size(2)
    Traceback (most recent call last):
    ...
    dmtp_jax.errors.RequestError: --block-size must be in [3, 64], got 2
"""

from __future__ import annotations

import dataclasses
import numbers

from dmtp_jax.errors import InputError, RequestError
from dmtp_jax.methods import ADAPTIVE, EAGLE3, METHODS

DECODE_METHODS = tuple(METHODS)                                           # `infer.py --method`
SPEC_METHODS = tuple(m for m in METHODS if METHODS[m].speculative)        # the speculative decoder's
TRAIN_METHODS = tuple(m for m in METHODS if METHODS[m].trains)            # drafters the trainer trains
VERIFY_MODES = ("rejection", "target-only", "block")
BLOCK_SIZE_RANGE = (3, 64)
MTP_STEPS_RANGE = (1, 15)
NEVER_MTP_THRESHOLD = 1.01          # dmtp-adaptive: no MTP top-1 probability reaches it
ADAPTIVE_THRESHOLD_RANGE = (0, NEVER_MTP_THRESHOLD)
DEFAULT_ADAPTIVE_THRESHOLD = 0.5    # dmtp-adaptive without a calibrated threshold in its fusion


def method_needs(method: str) -> dict[str, bool]:
    """Which models a method uses: `{"drafter", "mtp", "fusion", "draft_model"}` -> bool.

    Example:
        >>> method_needs("dmtp")
        {'drafter': True, 'mtp': True, 'fusion': True, 'draft_model': False}
    """
    known = METHODS.get(method)
    return (known or METHODS["ar"]).needs()


def check_method(method: str, methods: tuple[str, ...] = DECODE_METHODS, error: type = RequestError,
                 what: str = "method") -> None:
    """`method` is one of `methods`, else `error` ("unknown {what} ...; available: ...")."""
    if method not in methods:
        raise error(f"unknown {what} '{method}'; available: {', '.join(methods)}")


def _positive_int(flag: str, value, error: type) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise error(f"{flag} must be an integer >= 1, got {value!r}")


def _in_range(flag: str, value, bounds: tuple, error: type = RequestError, note: str = "") -> None:
    lo, hi = bounds
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not lo <= value <= hi:
        raise error(f"{flag} must be in [{lo}, {hi}]{note}, got {value}")


def check_block_size(block_size: int, error: type = RequestError, name: str = "--block-size") -> None:
    """A drafter block (verify slots) in [3, 64]; `name` is what the message calls it."""
    _in_range(name, block_size, BLOCK_SIZE_RANGE, error)


def check_mtp_steps(mtp_steps: int) -> None:
    """The MTP chain length of method `mtp` in [1, 15]."""
    _in_range("--mtp-steps", mtp_steps, MTP_STEPS_RANGE)


def check_adaptive_threshold(threshold: float) -> float:
    """dmtp-adaptive's MTP-confidence threshold in [0, 1.01] (1.01: never MTP's T1), as a float."""
    _in_range("--adaptive-threshold", threshold, ADAPTIVE_THRESHOLD_RANGE, note=" (1.01: never MTP's T1)")
    return float(threshold)


def check_rounds_per_dispatch(rounds: int) -> None:
    """Speculative rounds per jitted call: an integer >= 1 (not a bool), else `RequestError`."""
    _positive_int("--rounds-per-dispatch", rounds, RequestError)


def check_prefill_chunk(chunk: int) -> None:
    """Prefill chunk length: an integer >= 1."""
    _positive_int("--prefill-chunk", chunk, RequestError)


def check_max_new_tokens(max_new_tokens: int) -> None:
    """The generation budget: >= 1."""
    if max_new_tokens < 1:
        raise RequestError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")


def check_verify_mode(verify: str) -> None:
    """The sampled verifier: one of `VERIFY_MODES`."""
    if verify not in VERIFY_MODES:
        raise RequestError(f"--verify must be one of {', '.join(VERIFY_MODES)}, got {verify!r}")


def check_decode_options(*, method: str | None = None, mtp_steps: int | None = None, block_size: int | None = None,
                         max_new_tokens: int | None = None, rounds_per_dispatch: int | None = None,
                         adaptive_threshold: float | None = None, prefill_chunk: int | None = None,
                         verify: str | None = None) -> None:
    """Every decode option that is given (None: the decoder's default applies), each by its check
    above, whatever the method (a flag given is checked even where a method ignores it)."""
    for value, check in ((method, check_method), (max_new_tokens, check_max_new_tokens), (mtp_steps, check_mtp_steps),
                         (block_size, check_block_size), (rounds_per_dispatch, check_rounds_per_dispatch),
                         (prefill_chunk, check_prefill_chunk), (adaptive_threshold, check_adaptive_threshold),
                         (verify, check_verify_mode)):
        if value is not None:
            check(value)


MISSING_MODEL = {"drafter": "a DFlash drafter (--draft DIR)", "mtp": "the target's native MTP head",
                 "fusion": "its fusion (load the drafter with load_dmtp_drafter)",
                 "draft_model": "a smaller target of the same vocabulary (--draft SMALL_TARGET_DIR)"}


def missing_model_error(method: str, kind: str) -> RequestError:
    """The error for a model `kind` ("drafter", "mtp", "fusion") that `method` needs and lacks."""
    what = "an EAGLE-3 drafter (--eagle3 DIR)" if method == EAGLE3 and kind == "drafter" else MISSING_MODEL[kind]
    return RequestError(f"method '{method}' needs {what}")


def check_draft_head_applies(what: str, mtp_cfg, error: type = RequestError) -> None:
    """`what` (a drafting head, or a tool that fits or measures one from MTP states) with an MTP head
    of config `mtp_cfg` (None: no MTP head): `error` when that head scores with its own head
    (`own_head`: Gemma 4's assistant), which no drafting head replaces.

    Example:
        >>> check_draft_head_applies("--draft-head int8", None)
    """
    if getattr(mtp_cfg, "own_head", False):
        raise error(f"{what}: the Gemma 4 assistant scores with its own head, so a draft head does not apply")


def check_models_given(method: str, *, drafter=None, mtp=None, fusion=None, draft_model=None,
                       draft_head=None) -> None:
    """The loaded models `method` needs (`method_needs`) are there, dmtp-adaptive's drafter is a
    DFlash (version 1) drafter, and a drafting head `draft_head` applies to a method whose only drafter
    is its MTP head (`check_draft_head_applies`); else `RequestError` naming the missing flag.

    Example:
        >>> check_models_given("dflash")
        Traceback (most recent call last):
        ...
        dmtp_jax.errors.RequestError: method 'dflash' needs a DFlash drafter (--draft DIR)
    """
    needs = method_needs(method)
    for kind, model in (("drafter", drafter), ("mtp", mtp), ("fusion", fusion), ("draft_model", draft_model)):
        if needs[kind] and model is None:
            raise missing_model_error(method, kind)
    if needs["drafter"] and drafter.cfg.chained != (method == EAGLE3):
        raise RequestError(f"method '{method}' needs " + ("an EAGLE-3 drafter (--eagle3 DIR)" if method == EAGLE3 else
                                                         f"a DFlash drafter, not the EAGLE-3 one at {drafter.model_dir}"))
    if method == ADAPTIVE and drafter.cfg.version != 1:
        raise RequestError("dmtp-adaptive needs a DFlash (version 1) drafter")
    if draft_head is not None and needs["mtp"] and not needs["drafter"]:     # dmtp: the head serves the drafter
        check_draft_head_applies(f"--draft-head {draft_head.cfg.get('kind', 'efficient')}", mtp.cfg)


def check_draft_vocab(target_vocab: int, draft_vocab: int, draft_dir: str = "the draft model") -> None:
    """A draft model's vocabulary size must be the target's (it proposes ids the target verifies),
    else `RequestError`."""
    if int(draft_vocab) != int(target_vocab):
        raise RequestError(f"draft model {draft_dir} has a vocabulary of {draft_vocab} tokens, the target "
                           f"{target_vocab}: a draft model must share the target's tokenizer")


def verify_slots(method: str, *, mtp_steps: int, block_size: int | None, drafter_block_size: int | None) -> int:
    """The verify slots of a round (pending token + candidates), checked: `mtp_steps + 1` for
    `mtp`, else `block_size` or, when not given, the drafter's own block size (a method without a
    drafter: its `Method.slots`).

    Example:
        >>> verify_slots("mtp", mtp_steps=4, block_size=None, drafter_block_size=None)
        5
        >>> verify_slots("dflash", mtp_steps=4, block_size=None, drafter_block_size=16)
        16
    """
    if method == "mtp":
        check_mtp_steps(mtp_steps)
        return mtp_steps + 1
    if block_size is not None:
        check_block_size(block_size)
        return block_size
    if drafter_block_size is None and method in METHODS and METHODS[method].slots is not None:
        return METHODS[method].slots
    check_block_size(drafter_block_size, name="the drafter's block_size (set --block-size)")
    return drafter_block_size


def adaptive_threshold_for(method: str, threshold: float | None, calibrated: float | None) -> float | None:
    """dmtp-adaptive's threshold: the given one, else the drafter's calibrated one, else
    `DEFAULT_ADAPTIVE_THRESHOLD`, checked; None for every other method."""
    if method != ADAPTIVE:
        return None
    if threshold is None:
        threshold = DEFAULT_ADAPTIVE_THRESHOLD if calibrated is None else calibrated
    return check_adaptive_threshold(threshold)


def verify_modes(text: str) -> list[str]:
    """bench's `--verify`: a comma-separated list of verifiers, each once, or an `InputError`.

    Example:
        >>> verify_modes("rejection, block")
        ['rejection', 'block']
    """
    modes = list(dict.fromkeys(m.strip() for m in text.split(",") if m.strip()))
    bad = [m for m in modes if m not in VERIFY_MODES]
    if bad or not modes:
        raise InputError(f"--verify: unknown verifier(s) {bad or text!r}; available: {', '.join(VERIFY_MODES)}")
    return modes


def _non_negative(flag: str, value, error: type) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not value >= 0:
        raise error(f"{flag} must be >= 0, got {value}")


def check_positive_int(flag: str, value, error: type = InputError) -> None:
    """An integer >= 1 (`--batch-size`, `--prompt-len`, `--max-batch-size`, ...)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise error(f"{flag} must be >= 1, got {value}")


def check_positive(flag: str, value, error: type = InputError) -> None:
    """A number > 0 (serve's `--max-body-mb`, `--header-timeout`, ...)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not value > 0:
        raise error(f"{flag} must be > 0, got {value}")


def check_non_negative(flag: str, value, error: type = InputError) -> None:
    """A number >= 0, NaN refused (`--prefix-cache-gb`, `--max-waiting`, ...)."""
    _non_negative(flag, value, error)


def check_ce_chunk(value: int, flag: str = "--ce-chunk") -> None:
    """The loss's rows per chunk: >= 0 (0: no chunking), else `InputError`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise InputError(f"{flag} must be >= 0 (0: no chunking), got {value}")


def check_max_model_len(value: int, max_positions: int, error: type = InputError) -> None:
    """serve's `--max-model-len` in [2, the model's `max_position_embeddings`]."""
    if not 2 <= value <= max_positions:
        raise error(f"--max-model-len must be in [2, {max_positions}] (the model's max_position_embeddings), "
                    f"got {value}")


@dataclasses.dataclass(frozen=True)
class DraftHeadOptions:
    """The drafting side's LM head (`--draft-head*`): `kind` "full", "efficient" or "int8"; for the
    efficient head its `rank`, `shortlist`, vocabulary subset `vocab` (None: defaults / the whole
    vocabulary), the subset's token counts `counts` (a path) or a trained `factor` (a path)."""
    kind: str = "full"
    rank: int | None = None
    shortlist: int | None = None
    vocab: int | None = None
    counts: str | None = None
    factor: str | None = None


def check_draft_head_options(head: DraftHeadOptions) -> None:
    """The efficient head's rank, shortlist and subset are >= 1, and its flags are not given to
    another head (files: `preflight.check_draft_head`); else `InputError`."""
    if head.kind == "efficient":
        for flag, value in (("--draft-head-rank", head.rank), ("--draft-head-shortlist", head.shortlist)):
            if value is not None and value < 1:
                raise InputError(f"{flag} must be >= 1, got {value}")
    for flag, value in (("--draft-head-factor", head.factor), ("--draft-head-vocab", head.vocab)):
        if value is not None and head.kind != "efficient":
            raise InputError(f"{flag} is an option of --draft-head efficient")
    if head.factor is None and head.vocab is not None and head.vocab < 1:
        raise InputError(f"--draft-head-vocab must be >= 1, got {head.vocab}")


@dataclasses.dataclass(frozen=True)
class ModelSources:
    """Where a decoding method's models come from: the drafter directory `draft` (a DFlash / DMTP
    drafter, or a smaller target for `draft-model`), the EAGLE-3 drafter's directory `eagle3` (None:
    `draft` when it holds one), the MTP head's directory `mtp` (None: the target's), the weights'
    `dtype` and the drafting head."""
    draft: str | None = None
    eagle3: str | None = None
    mtp: str | None = None
    dtype: str = "float32"
    draft_head: DraftHeadOptions = DraftHeadOptions()

    @property
    def token_counts(self) -> str | None:
        """Where `--draft-head-vocab` reads its token counts: `--draft-head-counts`, else the drafter
        directory; None when neither is given."""
        return self.draft_head.counts or self.draft
