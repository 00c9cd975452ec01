"""`mtp.*` tensors <-> the MTP head: read from a target directory (or a separate one), written next to
the target's tensors. An MLA target's (DeepSeek-V3, GLM-4.7-Flash) head is its first next-token layer
`model.layers.{num_hidden_layers}.*` (`checkpoint/mla_names.py`), in the same `MtpHead`; a Gemma 4
target's is a `gemma4_assistant` directory (`--mtp DIR`, `checkpoint/assistant_ckpt.py`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from dmtp_jax.checkpoint.assistant_ckpt import is_assistant_dir, load_assistant
from dmtp_jax.checkpoint.hf import QWEN_NAME_RULES, LoadedModel, export_tensors, load_params
from dmtp_jax.checkpoint.mla_names import NEXTN_PREFIX, NEXTN_TENSOR, nextn_rules
from dmtp_jax.checkpoint.safetensors_io import CheckpointError, CheckpointReader
from dmtp_jax.config import TargetConfig
from dmtp_jax.models.mtp import MtpHead, mtp_config_for
from dmtp_jax.sharding import DEFAULT_RULES, MeshRules, make_mesh, state_shardings

MTP_PREFIX = "mtp."
MTP_NAME_RULES = (
    (r"pre_fc_norm_(embedding|hidden)", r"pre_fc_norm_\1.weight", "copy"),
    (r"fc", "fc.weight", "T"),
    (r"norm", "norm.weight", "copy"),
) + tuple((pattern, template.replace("model.layers", "layers"), how)
          for pattern, template, how in QWEN_NAME_RULES if pattern.startswith("layers"))


class MissingMtpError(CheckpointError):
    """The target carries no `mtp.*` tensors but an MTP method was asked for."""


def has_mtp(model_dir: str) -> bool:
    """Whether `model_dir`'s safetensors carry an MTP head (`mtp.fc.weight`, or a next-token
    layer's `model.layers.{i}.eh_proj.weight`), or is a `gemma4_assistant`."""
    if is_assistant_dir(model_dir):
        return True
    reader = CheckpointReader(model_dir)
    return f"{MTP_PREFIX}fc.weight" in reader or any(NEXTN_TENSOR.match(k) for k in reader.keys())


def mtp_names(target_cfg: TargetConfig) -> tuple[tuple, str]:
    """`(name rules, prefix)` of the target family's MTP head: Qwen's `mtp.*`, or the MLA
    families' first next-token layer."""
    if target_cfg.is_mla:
        return nextn_rules(QWEN_NAME_RULES, target_cfg.num_hidden_layers), NEXTN_PREFIX
    return MTP_NAME_RULES, MTP_PREFIX


def abstract_mtp(target_cfg: TargetConfig, dtype, mesh_rules: MeshRules = DEFAULT_RULES):
    model = nnx.eval_shape(lambda: MtpHead(mtp_config_for(target_cfg), dtype=jnp.dtype(dtype), rngs=nnx.Rngs(0),
                                           mesh_rules=mesh_rules))
    return nnx.split(model)


def load_mtp(model_dir: str, target_cfg: TargetConfig, dtype="float32", mesh: Mesh | None = None,
             mesh_rules: MeshRules = DEFAULT_RULES) -> LoadedModel:
    """The MTP head stored as `mtp.*` in `model_dir` (a target directory or an MTP-only one), or the
    `gemma4_assistant` that `model_dir` holds."""
    if is_assistant_dir(model_dir):
        return load_assistant(model_dir, target_cfg, dtype, mesh, mesh_rules)
    reader = CheckpointReader(model_dir)
    rules, prefix = mtp_names(target_cfg)
    fc = prefix + next(t for p, t, _ in rules if p == "fc")      # the fusion projection: `mtp.fc` / `eh_proj`
    if fc not in reader:
        raise MissingMtpError(f"{model_dir} has no native MTP head (no '{fc}'); the methods "
                              "mtp / dmtp need a target that carries one, or --mtp DIR")
    mesh = mesh or make_mesh()
    graphdef, abstract = abstract_mtp(target_cfg, dtype, mesh_rules)
    state, _ = load_params(abstract, reader, mesh, dtype, rules=rules, prefix=prefix, mesh_rules=mesh_rules)
    return LoadedModel(mtp_config_for(target_cfg), graphdef, state, mesh, model_dir)


def init_mtp(target_cfg: TargetConfig, dtype="float32", mesh: Mesh | None = None, seed: int = 0,
             mesh_rules: MeshRules = DEFAULT_RULES) -> LoadedModel:
    """A random MTP head placed at its shardings (tests, pretraining)."""
    mesh = mesh or make_mesh()
    graphdef, abstract = abstract_mtp(target_cfg, dtype, mesh_rules)
    make = jax.jit(lambda: nnx.split(MtpHead(mtp_config_for(target_cfg), dtype=jnp.dtype(dtype),
                                             rngs=nnx.Rngs(seed), mesh_rules=mesh_rules))[1],
                   out_shardings=state_shardings(abstract, mesh, mesh_rules))
    return LoadedModel(mtp_config_for(target_cfg), graphdef, make(), mesh)


def mtp_tensors(mtp: LoadedModel, dtype=None, target_cfg: TargetConfig | None = None) -> dict[str, np.ndarray]:
    """HF-named `mtp.*` tensors (an MLA target's, given `target_cfg`: its next-token layer's), for
    `save_target(..., extra_tensors=mtp_tensors(mtp))`."""
    rules, prefix = mtp_names(target_cfg) if target_cfg is not None else (MTP_NAME_RULES, MTP_PREFIX)
    return export_tensors(mtp.state, rules=rules, prefix=prefix, dtype=dtype)
