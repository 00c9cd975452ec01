"""Drafting heads from files and from the loaded target: a drafter directory's token counts and
trained factor (`train.py token-counts`, `train.py head-factor`), and the efficient / int8 heads
made from the target's LM head, placed on the target's mesh (`make_draft_head`)."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dmtp_jax.checkpoint.hf import LoadedModel
from dmtp_jax.checkpoint.safetensors_io import SafetensorsFile
from dmtp_jax.errors import InputError
from dmtp_jax.models.draft_head import (DRAFT_HEADS, EfficientHead, Int8Head, efficient_shape, factor_head,
                                        frequent_ids, quantize_head)
from dmtp_jax.sharding import DEFAULT_RULES, MeshRules, state_shardings


TOKEN_COUNTS = "token_counts.npy"
HEAD_FACTOR = "head_factor.safetensors"
_MISSING = {TOKEN_COUNTS: ("token counts",
                           "write them with: python train.py token-counts --target T --data D --out DIR"),
            HEAD_FACTOR: ("trained head factor",
                          "train one with: python train.py head-factor --target T --data D --out DIR")}


def drafter_file(path: str, name: str) -> str:
    """The file `path` names for a drafter directory's `name`: `path` itself, or `path/name` when `path`
    is a directory; an `InputError` when there is none.

    Example:
        >>> drafter_file("/nope", TOKEN_COUNTS)
        Traceback (most recent call last):
        ...
        dmtp_jax.errors.InputError: no token counts at /nope
    """
    file = os.path.join(path, name) if os.path.isdir(path) else path
    if not os.path.isfile(file):
        what, hint = _MISSING[name]
        raise InputError(f"no {what} at {file}", hint=hint)
    return file


def read_token_counts(path: str, vocab: int) -> np.ndarray:
    """Token counts `[vocab]` from `path` (`drafter_file`)."""
    file = drafter_file(path, TOKEN_COUNTS)
    counts = np.load(file, allow_pickle=False)
    if counts.shape != (vocab,):
        raise InputError(f"{file} holds counts of shape {counts.shape}, the target's vocabulary is {vocab}")
    return counts


def read_head_factor(path: str) -> dict:
    """`{"down" [H, r], "up" [r, C][, "ids" [C]]}` numpy arrays of a trained factor at `path`."""
    f = SafetensorsFile(drafter_file(path, HEAD_FACTOR))
    return {k: np.array(f.array(k)) for k in f.keys()}


def make_efficient_head(target, rank: int | None = None, shortlist: int | None = None, counts=None,
                        subset: int | None = None, factor: dict | None = None,
                        mesh_rules: MeshRules = DEFAULT_RULES):
    """A `LoadedModel` holding the efficient head of a loaded target (`factor_head` of its LM head) at its
    mesh shardings (placed with `mesh_rules`). `subset` N with `counts`: score only the N most frequent
    ids. `factor`: a trained factor instead of the SVD (its shape sets rank and subset)."""
    ids = None
    if factor is not None:
        trained_rank = factor["down"].shape[1]
        ids = factor["ids"][factor["ids"] >= 0] if "ids" in factor else None
        for flag, given, own in (("--draft-head-rank", rank, trained_rank),
                                 ("--draft-head-vocab", subset, None if ids is None else len(ids))):
            if given is not None and given != own:
                raise InputError(f"{flag} {given} differs from the trained head factor's {own}")
        rank, subset = trained_rank, None if ids is None else len(ids)
    cfg, shape = efficient_shape(target.cfg, rank, shortlist, subset)
    if factor is not None:
        want = {"down": (target.cfg.hidden_size, rank), "up": (rank, shape["subset"] or target.cfg.vocab_size)}
        if any(factor[k].shape != v for k, v in want.items()):
            raise InputError(f"the trained head factor's shapes {[factor[k].shape for k in want]} do not fit this "
                             f"target (want {list(want.values())})")
        cfg["trained"] = True
    elif subset:
        if counts is None:
            raise InputError("--draft-head-vocab needs token counts: pass --draft-head-counts FILE or a --draft "
                             "directory holding token_counts.npy", hint=_MISSING[TOKEN_COUNTS][1])
        ids = frequent_ids(counts, subset)
    model = nnx.merge(target.graphdef, target.state)
    head = EfficientHead(**shape, dtype=target.state_dtype, mesh_rules=mesh_rules)
    pair = None if factor is None else (factor["down"], factor["up"])
    return _loaded(target, cfg, factor_head(head, model.head_weight(), ids, tied=target.cfg.tie_word_embeddings,
                                            factor=pair), mesh_rules)


def _loaded(target, head_cfg: dict, head, mesh_rules: MeshRules):
    """A made head as a `LoadedModel`, its params at their shardings on the target's mesh."""
    graphdef, state = nnx.split(head)
    state = jax.device_put(state, state_shardings(state, target.mesh, mesh_rules))
    return LoadedModel(head_cfg, graphdef, state, target.mesh, None)


def make_draft_head(target, kind: str, rank: int | None = None, shortlist: int | None = None, counts=None,
                    subset: int | None = None, factor: dict | None = None, mesh_rules: MeshRules = DEFAULT_RULES):
    """A `LoadedModel` holding the drafting head of `kind` ("efficient": `make_efficient_head`; "int8":
    `quantize_head` of the LM head) at its mesh shardings."""
    if kind == "efficient":
        return make_efficient_head(target, rank, shortlist, counts, subset, factor, mesh_rules)
    if kind != "int8":
        raise InputError(f"unknown draft head '{kind}'; use {', '.join(DRAFT_HEADS)}")
    cfg = target.cfg
    model = nnx.merge(target.graphdef, target.state)
    return _loaded(target, {"kind": "int8"}, quantize_head(Int8Head(hidden=cfg.hidden_size, vocab=cfg.vocab_size),
                                                           model.head_weight(), tied=cfg.tie_word_embeddings), mesh_rules)


def abstract_efficient_head(target_cfg, dtype, rank: int | None = None, shortlist: int | None = None,
                            subset: int | None = None, mesh_rules: MeshRules = DEFAULT_RULES):
    """`(cfg, graphdef, abstract state)` of an efficient head for a target config (nothing allocated)."""
    cfg, shape = efficient_shape(target_cfg, rank, shortlist, subset)
    head = nnx.eval_shape(lambda: EfficientHead(**shape, dtype=jnp.dtype(dtype), mesh_rules=mesh_rules))
    return cfg, *nnx.split(head)


def abstract_draft_head(kind: str, target_cfg, dtype, rank: int | None = None, shortlist: int | None = None,
                        subset: int | None = None, mesh_rules: MeshRules = DEFAULT_RULES):
    """`(cfg, graphdef, abstract state)` of a drafting head of `kind` ("efficient" or "int8") for a
    target config, nothing allocated (`plan`)."""
    if kind == "efficient":
        return abstract_efficient_head(target_cfg, dtype, rank, shortlist, subset, mesh_rules)
    if kind != "int8":
        raise InputError(f"unknown draft head '{kind}'; use {', '.join(DRAFT_HEADS)}")
    head = nnx.eval_shape(lambda: Int8Head(hidden=target_cfg.hidden_size, vocab=target_cfg.vocab_size))
    return {"kind": "int8"}, *nnx.split(head)
