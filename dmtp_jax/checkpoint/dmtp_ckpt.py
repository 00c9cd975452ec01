"""DMTP drafter directories: a DFlash directory plus `fusion.*` tensors and a `dmtp_config` block
(`{"method": ..., "rank": ...}`) in `config.json`. A plain DFlash directory loads as a DMTP
drafter with its fusion at the zero init (how DMTP fine-tuning starts from DFlash)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from dmtp_jax.checkpoint.dflash_ckpt import load_drafter, save_drafter
from dmtp_jax.checkpoint.hf import LoadedModel, export_tensors, load_params
from dmtp_jax.checkpoint.safetensors_io import CheckpointError, CheckpointReader
from dmtp_jax.config import ConfigError, read_config_json
from dmtp_jax.methods import DMTP_METHODS, METHODS
from dmtp_jax.models.fusion import T1Fusion
from dmtp_jax.sharding import DEFAULT_RULES, MeshRules, make_mesh, state_shardings

FUSION_PREFIX = "fusion."
FUSION_NAME_RULES = (
    (r"norm_(embedding|hidden)", r"norm_\1.weight", "copy"),
    (r"(proj|down|up)", r"\1.weight", "T"),
)


def _fusion_factory(method: str, hidden: int, rank: int, eps: float, dtype, seed: int = 0):
    return lambda: T1Fusion(method, hidden=hidden, rank=rank, eps=eps, dtype=jnp.dtype(dtype),
                            rngs=nnx.Rngs(seed))


def init_fusion(method: str, hidden: int, eps: float, dtype="float32", mesh: Mesh | None = None,
                rank: int = 0, seed: int = 0, mesh_rules: MeshRules = DEFAULT_RULES) -> LoadedModel:
    """The fusion of `method` at its init (zero residual / identity replace), placed on the mesh."""
    mesh = mesh or make_mesh()
    make = _fusion_factory(method, hidden, rank, eps, dtype, seed)
    graphdef, abstract = nnx.split(nnx.eval_shape(make))
    state = jax.jit(lambda: nnx.split(make())[1],
                    out_shardings=state_shardings(abstract, mesh, mesh_rules))()
    return LoadedModel({"method": method, "rank": rank}, graphdef, state, mesh)


def _layout(method) -> tuple | None:
    """A DMTP method's block layout and fusion variant (None for anything else)."""
    m = METHODS.get(method)
    return (m.anchors, m.variant) if m is not None and m.fusion else None


def load_dmtp_drafter(draft_dir: str, target_cfg, method: str | None = None, dtype="float32",
                      mesh: Mesh | None = None, *, same_layout: bool = False) -> tuple[LoadedModel, LoadedModel]:
    """(DFlash drafter, fusion) of a DMTP directory, or of a plain DFlash directory with a fresh fusion
    for `method` (default `dmtp`). `same_layout` (`--init-from`): a drafter of another DMTP method
    with the same block layout and fusion loads as `method`, its fusion kept."""
    mesh = mesh or make_mesh()
    drafter = load_drafter(draft_dir, target_cfg, dtype, mesh)
    stored = read_config_json(draft_dir).get("dmtp_config")
    if stored and method and stored.get("method") != method:
        if not (same_layout and _layout(stored.get("method")) == _layout(method)):
            raise ConfigError(f"{draft_dir} holds a '{stored.get('method')}' drafter, not '{method}'")
        stored = {k: v for k, v in stored.items() if k != "threshold"} | {"method": method}
    method = (stored or {}).get("method") or method or "dmtp"
    if method not in DMTP_METHODS:
        raise ConfigError(f"{draft_dir}: unknown dmtp_config method '{method}'")
    rank = int((stored or {}).get("rank", 0))
    eps = drafter.cfg.rms_norm_eps
    fusion = init_fusion(method, drafter.cfg.hidden_size, eps, dtype, mesh, rank)
    if stored and jax.tree.leaves(fusion.state):
        reader = CheckpointReader(draft_dir)
        make = _fusion_factory(method, drafter.cfg.hidden_size, rank, eps, dtype)
        graphdef, abstract = nnx.split(nnx.eval_shape(make))
        try:
            state, _ = load_params(abstract, reader, mesh, dtype, rules=FUSION_NAME_RULES, prefix=FUSION_PREFIX)
        except CheckpointError as e:
            raise CheckpointError(f"{draft_dir} declares dmtp_config but its fusion is incomplete: {e}") from None
        fusion = LoadedModel(fusion.cfg, graphdef, state, mesh, draft_dir)
    if stored and "threshold" in stored:        # dmtp-adaptive's calibrated MTP-confidence threshold
        fusion = dataclasses.replace(fusion, cfg={**fusion.cfg, "threshold": float(stored["threshold"])})
    return drafter, fusion


def save_dmtp_drafter(drafter: LoadedModel, fusion: LoadedModel, out_dir: str, dtype=None):
    """A DFlash directory (loadable by the `dflash` package) + `fusion.*` + `dmtp_config`."""
    tensors = export_tensors(fusion.state, rules=FUSION_NAME_RULES, prefix=FUSION_PREFIX, dtype=dtype)
    save_drafter(drafter, out_dir, dtype, extra_tensors={k: np.asarray(v) for k, v in tensors.items()},
                 extra_config={"dmtp_config": dict(fusion.cfg)})
