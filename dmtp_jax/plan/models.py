"""Abstract models for planning: every parameter a `jax.ShapeDtypeStruct` at its mesh sharding,
nothing allocated, from a checkpoint directory or a bare `config.json`; the same `LoadedModel`s
the decoders and the trainer take."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from dmtp_jax.checkpoint.dflash_ckpt import abstract_drafter
from dmtp_jax.checkpoint.eagle3_ckpt import eagle3_config
from dmtp_jax.checkpoint.hf import LoadedModel, abstract_target, place_abstract
from dmtp_jax.checkpoint.mtp_ckpt import abstract_mtp
from dmtp_jax.config import ConfigError, TargetConfig, read_config_json
from dmtp_jax.decode import method_needs
from dmtp_jax.methods import EAGLE3
from dmtp_jax.models.dflash_config import DFlashConfig, check_fits_target
from dmtp_jax.models.drafter_shape import DEFAULT_PLAN_BLOCK, default_drafter_config
from dmtp_jax.models.eagle3 import DEFAULT_BLOCK_SIZE as DEFAULT_EAGLE3_BLOCK, Eagle3Drafter, default_eagle3_config
from dmtp_jax.models.eagle3 import check_fits_target as check_eagle3_fits
from dmtp_jax.models.fusion import T1Fusion
from dmtp_jax.models.gemma4_assistant import GemmaAssistant, assistant_config_from_hf
from dmtp_jax.models.mtp import mtp_config_for
from dmtp_jax.sharding import replicated


def abstract_args(tree, mesh: Mesh):
    """Every leaf of `tree` as a `ShapeDtypeStruct`; leaves without a sharding are replicated on
    `mesh` (host arrays, PRNG keys, scalars)."""
    def one(x):
        if x is None:
            return None
        sharding = getattr(x, "sharding", None)
        if not isinstance(sharding, jax.sharding.NamedSharding) or sharding.mesh != mesh:
            sharding = replicated(mesh)
        shape = x.shape if hasattr(x, "shape") else np.shape(x)
        dtype = x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
    return jax.tree.map(one, tree)


def shard_bytes(tree) -> int:
    """Bytes one device holds of a tree of sharded arrays / `ShapeDtypeStruct`s (its own shard of
    each leaf; a replicated leaf counts whole)."""
    total = 0
    for x in jax.tree.leaves(tree):
        sharding = getattr(x, "sharding", None)
        shape = sharding.shard_shape(x.shape) if sharding is not None else x.shape
        total += int(np.prod(shape)) * np.dtype(x.dtype).itemsize
    return total


def target_config_of(path: str) -> TargetConfig:
    """The target config of a checkpoint directory or of a `config.json` file."""
    return TargetConfig.from_hf_dict(read_config_json(path))


def abstract_target_model(path: str, mesh: Mesh, dtype) -> LoadedModel:
    cfg = target_config_of(path)
    graphdef, abstract = abstract_target(cfg, dtype)
    return place_abstract(cfg, graphdef, abstract, mesh, path)


def drafter_config_of(path: str | None, target_cfg: TargetConfig, block_size: int | None):
    """The drafter config of `--draft DIR|CONFIG.json`, or `default_drafter_config` for the target;
    `(DFlashConfig, the stored dmtp_config block or None)`."""
    if path is None:
        return default_drafter_config(target_cfg, block_size=block_size or DEFAULT_PLAN_BLOCK), None
    raw = read_config_json(path)
    dcfg = DFlashConfig.from_hf_dict(raw)
    check_fits_target(dcfg, target_cfg)
    if dcfg.num_target_layers is None:
        dcfg = dataclasses.replace(dcfg, num_target_layers=target_cfg.num_hidden_layers)
    return dcfg, raw.get("dmtp_config")


def abstract_eagle3(path: str | None, target_cfg: TargetConfig, block_size: int | None, dtype):
    """`(Eagle3Config, graphdef, abstract state)` of `--draft DIR|CONFIG.json` (checked against the
    target), or of `default_eagle3_config` for the target."""
    if path is None:
        cfg = default_eagle3_config(target_cfg, block_size or DEFAULT_EAGLE3_BLOCK)
    else:
        cfg = eagle3_config(read_config_json(path), target_cfg.num_hidden_layers)
        check_eagle3_fits(cfg, target_cfg)
        cfg = dataclasses.replace(cfg, block_size=block_size or cfg.block_size)
    return (cfg, *nnx.split(nnx.eval_shape(lambda: Eagle3Drafter(cfg, dtype=jnp.dtype(dtype), rngs=nnx.Rngs(0)))))


def abstract_mtp_head(target_path: str, target_cfg: TargetConfig, mtp_path: str | None, mesh: Mesh,
                      dtype) -> LoadedModel:
    """The family's own MTP head, abstract: a `gemma4_assistant` of `mtp_path` (a directory or its
    `config.json`; a Gemma 4 target has no other), else the native head of the target's layer shape
    (Qwen's `mtp.*`, DeepSeek's / GLM's next-token layer). A native head the target's config does not
    declare is still planned (Qwen3-Next ships `mtp.*` undeclared): its `model_dir` is None then."""
    raw = read_config_json(mtp_path) if mtp_path else {}
    if raw.get("model_type") == "gemma4_assistant":
        acfg = assistant_config_from_hf(raw, target_cfg)
        model = nnx.eval_shape(lambda: GemmaAssistant(acfg, dtype=jnp.dtype(dtype), rngs=nnx.Rngs(0)))
        return place_abstract(acfg, *nnx.split(model), mesh, mtp_path)
    if target_cfg.gemma is not None:
        raise ConfigError("a Gemma 4 target drafts T1 with its gemma4_assistant: --mtp DIR|CONFIG.json of one")
    declared = target_path if target_cfg.mtp_num_hidden_layers else None
    return place_abstract(mtp_config_for(target_cfg), *abstract_mtp(target_cfg, dtype), mesh, mtp_path or declared)


def plan_models(target_path: str, method: str, mesh: Mesh, dtype, draft_path: str | None = None,
                block_size: int | None = None, mtp_path: str | None = None) -> dict[str, LoadedModel]:
    """`{"target", and as `method` needs them "drafter", "mtp", "fusion", "draft_model"}`, all
    abstract (the draft model: the target checkpoint at `draft_path`; the MTP head:
    `abstract_mtp_head`, `mtp_path` a separate head's directory or config)."""
    target = abstract_target_model(target_path, mesh, dtype)
    models = {"target": target}
    needs = method_needs(method)
    if method == EAGLE3:
        models["drafter"] = place_abstract(*abstract_eagle3(draft_path, target.cfg, block_size, dtype), mesh,
                                           draft_path)
    elif needs["drafter"]:
        dcfg, stored = drafter_config_of(draft_path, target.cfg, block_size)
        models["drafter"] = place_abstract(dcfg, *abstract_drafter(dcfg, dtype), mesh, draft_path)
        if needs["fusion"]:
            stored = stored or {}
            if stored.get("method") not in (None, method):
                raise ConfigError(f"{draft_path} holds a '{stored.get('method')}' drafter, not '{method}'")
            rank = int(stored.get("rank", 0))
            fusion = nnx.eval_shape(lambda: T1Fusion(method, hidden=dcfg.hidden_size, rank=rank,
                                                     eps=dcfg.rms_norm_eps, dtype=jnp.dtype(dtype),
                                                     rngs=nnx.Rngs(0)))
            cfg = {"method": method, "rank": rank, **({"threshold": stored["threshold"]} if "threshold" in stored
                                                       else {})}
            models["fusion"] = place_abstract(cfg, *nnx.split(fusion), mesh, draft_path)
    if needs["draft_model"]:
        if not draft_path:
            raise ConfigError(f"method '{method}' needs a smaller target of the same vocabulary (--draft DIR)")
        models["draft_model"] = abstract_target_model(draft_path, mesh, dtype)
    if needs["mtp"]:
        models["mtp"] = abstract_mtp_head(target_path, target.cfg, mtp_path, mesh, dtype)
    return models
