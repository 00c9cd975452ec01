"""DFlash / DFlash2 drafter checkpoints (z-lab `dflash` layout) <-> `DFlashDrafter` params.

HF names have no `model.` prefix (`fc.weight`, `layers.{i}.self_attn.q_proj.weight`, ...);
DFlash2 adds `layers.{i}.{attention_conv,mlp_conv}.*` and `candidate_selector.*`, whose codebooks
load with or without a `.weight` suffix."""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from dmtp_jax.checkpoint.hf import LoadedModel, export_tensors, load_params
from dmtp_jax.checkpoint.safetensors_io import CheckpointError, CheckpointReader, write_sharded
from dmtp_jax.config import read_config_json
from dmtp_jax.models.dflash import DFlashDrafter
from dmtp_jax.models.dflash_config import DFlashConfig, check_fits_target
from dmtp_jax.sharding import DEFAULT_RULES, MeshRules, make_mesh, state_shardings

_LAYER = r"layers\.(\d+)\."
# (regex on our dotted param path, HF name template, "copy" | "T")
DFLASH_NAME_RULES = (
    (r"fc", "fc.weight", "T"),
    (r"(hidden_norm|norm)", r"\1.weight", "copy"),
    (_LAYER + r"(input_layernorm|post_attention_layernorm)", r"layers.\1.\2.weight", "copy"),
    (_LAYER + r"self_attn\.([qkvo])_proj", r"layers.\1.self_attn.\2_proj.weight", "T"),
    (_LAYER + r"self_attn\.([qkvo])_bias", r"layers.\1.self_attn.\2_proj.bias", "copy"),
    (_LAYER + r"self_attn\.([qk])_norm", r"layers.\1.self_attn.\2_norm.weight", "copy"),
    (_LAYER + r"mlp\.(gate|up|down)_proj", r"layers.\1.mlp.\2_proj.weight", "T"),
    (_LAYER + r"(attention_conv|mlp_conv)\.base_kernel", r"layers.\1.\2.base_kernel", "copy"),
    (_LAYER + r"(attention_conv|mlp_conv)\.kernel_projection",
     r"layers.\1.\2.kernel_projection.weight", "T"),
    (r"candidate_selector\.(predecessor_codebook|successor_codebook)", r"candidate_selector.\1", "copy"),
    (r"candidate_selector\.hidden_projection", "candidate_selector.hidden_projection.weight", "T"),
)
# The same table for checkpoints written by the reference's `save_pretrained` (codebooks `.weight`).
DFLASH_NAME_RULES_CODEBOOK_WEIGHT = tuple(
    (p, t + ".weight", how) if p.startswith(r"candidate_selector\.(pred") else (p, t, how)
    for p, t, how in DFLASH_NAME_RULES)
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# Tensors other modules keep beside a drafter (DMTP fusion: dmtp_jax.checkpoint.dmtp_ckpt).
DRAFTER_SIDECAR_PREFIXES = ("fusion.",)


LoadedDrafter = LoadedModel      # cfg: DFlashConfig


def load_dflash_config(draft_dir: str) -> DFlashConfig:
    """The `DFlashConfig` of a drafter directory's `config.json`."""
    return DFlashConfig.from_hf_dict(read_config_json(draft_dir))


def abstract_drafter(dcfg: DFlashConfig, dtype):
    """(graphdef, abstract state) without allocating any parameter."""
    model = nnx.eval_shape(lambda: DFlashDrafter(dcfg, dtype=jnp.dtype(dtype), rngs=nnx.Rngs(0)))
    return nnx.split(model)


def load_drafter(draft_dir: str, target_cfg, dtype="float32", mesh: Mesh | None = None,
                 mesh_rules: MeshRules = DEFAULT_RULES) -> LoadedDrafter:
    """Loads a `dflash` drafter directory; refuses drafters that do not fit `target_cfg` and checkpoints
    with missing, misshapen or unexpected tensors."""
    dcfg = load_dflash_config(draft_dir)
    check_fits_target(dcfg, target_cfg)
    if dcfg.num_target_layers is None:
        dcfg = dataclasses.replace(dcfg, num_target_layers=target_cfg.num_hidden_layers)
    mesh = mesh or make_mesh()
    graphdef, abstract = abstract_drafter(dcfg, dtype)
    reader = CheckpointReader(draft_dir)
    rules = DFLASH_NAME_RULES
    if "candidate_selector.predecessor_codebook.weight" in reader:
        rules = DFLASH_NAME_RULES_CODEBOOK_WEIGHT
    state, used = load_params(abstract, reader, mesh, dtype, rules=rules, mesh_rules=mesh_rules)
    unexpected = [k for k in reader.keys() if k not in used and not k.endswith(IGNORED_SUFFIXES)
                  and not k.startswith(DRAFTER_SIDECAR_PREFIXES)]
    if unexpected:
        more = f" (and {len(unexpected) - 5} more)" if len(unexpected) > 5 else ""
        kind = "DFlash2DraftModel" if dcfg.version == 2 else "DFlashDraftModel"
        raise CheckpointError(f"{draft_dir}: unexpected tensors for {kind}: "
                              f"{', '.join(sorted(unexpected)[:5])}{more}")
    return LoadedDrafter(dcfg, graphdef, state, mesh, draft_dir)


def init_drafter(dcfg: DFlashConfig, dtype="float32", mesh: Mesh | None = None, seed: int = 0,
                 mesh_rules: MeshRules = DEFAULT_RULES) -> LoadedDrafter:
    """Random init placed at the mesh shardings (one jit, no host copy); DFlash2 convs start as the
    identity, the successor codebook at zero."""
    mesh = mesh or make_mesh()
    graphdef, abstract = abstract_drafter(dcfg, dtype)
    shardings = state_shardings(abstract, mesh, mesh_rules)
    make = jax.jit(lambda: nnx.split(DFlashDrafter(dcfg, dtype=jnp.dtype(dtype), rngs=nnx.Rngs(seed)))[1],
                   out_shardings=shardings)
    return LoadedDrafter(dcfg, graphdef, make(), mesh)


def save_drafter(loaded: LoadedDrafter, out_dir: str, dtype=None, max_shard_bytes: int = 2 << 30,
                 extra_tensors: dict | None = None, extra_config: dict | None = None):
    """Writes `config.json` (nested `dflash_config`) + safetensors that `dflash` loads; `extra_tensors`
    and `extra_config` carry sidecars (DMTP's `fusion.*`, `dmtp_config`)."""
    tensors = export_tensors(loaded.state, rules=DFLASH_NAME_RULES, dtype=dtype)
    tensors.update(extra_tensors or {})
    os.makedirs(out_dir, exist_ok=True)
    write_sharded(out_dir, tensors, max_shard_bytes)
    hf_cfg = {**loaded.cfg.to_hf_dict(), **(extra_config or {})}
    hf_cfg["dtype"] = np.dtype(jnp.dtype(dtype or loaded.state_dtype)).name
    with open(os.path.join(out_dir, "config.json"), "w") as fh:
        json.dump(hf_cfg, fh, indent=2)
