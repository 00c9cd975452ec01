"""The decoding methods: one registry that options, loading, the decoders, the trainer and the CLI
read. A method names the models it needs, the layout of its verify block and its proposer; a new
drafting method is one `Method` here plus its proposer in `decode/proposers.py`.

Example:
    >>> METHODS["dmtp"].needs()
    {'drafter': True, 'mtp': True, 'fusion': True, 'draft_model': False}
    >>> [m for m in METHODS if METHODS[m].trains][:3]
    ['dflash', 'dmtp', 'dmtp-single']
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Method:
    """One decoding method.

    `drafter`, `mtp`, `fusion`, `draft_model`: the models it runs (a DFlash drafter, the target's
    native MTP head, DMTP's T1 fusion tensors, a smaller target of the same vocabulary). `anchors` (DMTP only): rows known before the drafter runs, 2 =
    `[A, T1, ...]`, 1 = `[T1, ...]`; `variant`: the T1 fusion variant (None: candidate only).
    `proposer`: its kind in `decode.proposers.PROPOSERS` (None: plain decoding). `trains`: `train.py`
    trains its drafter. `slots`: its verify slots when `--block-size` is not given and no drafter
    has a block size (lookup, draft-model)."""
    name: str
    drafter: bool = False
    mtp: bool = False
    fusion: bool = False
    anchors: int = 0
    variant: str | None = None
    proposer: str | None = None
    trains: bool = False
    draft_model: bool = False
    slots: int | None = None

    @property
    def speculative(self) -> bool:
        return self.proposer is not None

    def needs(self) -> dict[str, bool]:
        return {"drafter": self.drafter, "mtp": self.mtp, "fusion": self.fusion, "draft_model": self.draft_model}


def _dmtp(name: str, anchors: int, variant: str | None, proposer: str = "dmtp") -> Method:
    return Method(name, drafter=True, mtp=True, fusion=True, anchors=anchors, variant=variant, proposer=proposer,
                  trains=True)


ADAPTIVE = "dmtp-adaptive"
METHODS: dict[str, Method] = {m.name: m for m in (
    Method("ar"),
    Method("mtp", mtp=True, proposer="mtp-chain"),
    Method("dflash", drafter=True, proposer="dflash", trains=True),
    _dmtp("dmtp", 2, "t1-residual"),
    _dmtp("dmtp-single", 1, "t1-replace"),
    _dmtp("dmtp-candidate", 1, None),
    _dmtp("dmtp-lowrank", 1, "t1-lowrank"),
    _dmtp("dmtp-mask-residual", 1, "mask-residual"),
    _dmtp("dmtp-ctx-fusion", 1, "ctx-fusion"),
    _dmtp("dmtp-ctx-mtp", 1, "ctx-mtp"),
    _dmtp(ADAPTIVE, 2, "t1-residual", proposer=ADAPTIVE),
    Method("lookup", proposer="lookup", slots=8),
    Method("draft-model", draft_model=True, proposer="draft-model", slots=5),
    Method("eagle3", drafter=True, proposer="eagle3-chain", trains=True),
)}
EAGLE3 = "eagle3"       # its drafter is an EAGLE-3 one (`models/eagle3.py`), not a DFlash drafter
DMTP_METHODS = tuple(m for m in METHODS if METHODS[m].fusion)
