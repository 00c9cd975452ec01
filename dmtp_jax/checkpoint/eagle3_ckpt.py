"""EAGLE-3 drafter checkpoints (the `LlamaForCausalLMEagle3` layout SpecForge writes and SGLang /
vLLM load) <-> `Eagle3Drafter` params (tensor names and config fields: docs/models-detail.md). Loading
checks the config against the target before reading any tensor."""

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
from dmtp_jax.errors import ConfigError
from dmtp_jax.hf_config import require, rope
from dmtp_jax.models.eagle3 import (ARCHITECTURE, DEFAULT_BLOCK_SIZE, DraftVocab, Eagle3Config, Eagle3Drafter,
                                    check_fits_target, default_layer_ids)
from dmtp_jax.sharding import DEFAULT_RULES, MeshRules, make_mesh, replicated, state_shardings

EAGLE3_NAME_RULES = (
    (r"fc", "fc.weight", "T"),
    (r"norm", "norm.weight", "copy"),
    (r"lm_head", "lm_head.weight", "T"),
    (r"embed_tokens", "embed_tokens.weight", "copy"),
    (r"midlayer\.(input_layernorm|hidden_norm|post_attention_layernorm)", r"midlayer.\1.weight", "copy"),
    (r"midlayer\.self_attn\.([qkvo])_proj", r"midlayer.self_attn.\1_proj.weight", "T"),
    (r"midlayer\.mlp\.(gate|up|down)_proj", r"midlayer.mlp.\1_proj.weight", "T"),
)
VOCAB_MAPS = ("d2t", "t2d")
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def is_eagle3_dir(model_dir: str) -> bool:
    """Whether a directory's `config.json` names `LlamaForCausalLMEagle3`."""
    try:
        return ARCHITECTURE in (read_config_json(model_dir).get("architectures") or [])
    except ConfigError:
        return False


def eagle3_config(d: dict, num_target_layers: int, own_embeddings: bool = False) -> Eagle3Config:
    """The `Eagle3Config` of a `config.json` dict (`num_target_layers`: for the default taps).

    Example:
        >>> eagle3_config({"architectures": [ARCHITECTURE], "hidden_size": 16, "intermediate_size": 32,
        ...     "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 64,
        ...     "draft_vocab_size": 32}, 36).target_layer_ids
        (1, 17, 32)
    """
    where = "EAGLE-3 drafter config"
    archs = d.get("architectures") or []
    if ARCHITECTURE not in archs:
        raise ConfigError(f"{where}: 'architectures' {archs} does not name {ARCHITECTURE}")
    if int(d.get("num_hidden_layers", 1)) != 1:
        raise ConfigError(f"{where}: 'num_hidden_layers' must be 1, got {d['num_hidden_layers']}")
    eagle = d.get("eagle_config") or {}
    ids = eagle.get("eagle_aux_hidden_state_layer_ids")
    hidden, heads = int(require(d, "hidden_size", where)), int(require(d, "num_attention_heads", where))
    vocab = int(require(d, "vocab_size", where))
    theta, _ = rope(d, where)
    return Eagle3Config(
        hidden_size=hidden, intermediate_size=int(require(d, "intermediate_size", where)),
        num_attention_heads=heads, num_key_value_heads=int(d.get("num_key_value_heads") or heads),
        head_dim=int(d.get("head_dim") or hidden // heads), vocab_size=vocab,
        draft_vocab_size=int(d.get("draft_vocab_size") or vocab),
        target_layer_ids=tuple(int(i) for i in ids) if ids else default_layer_ids(num_target_layers),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)), rope_theta=theta,
        max_position_embeddings=int(d.get("max_position_embeddings", 32768)), own_embeddings=own_embeddings,
        block_size=int(eagle.get("dmtp_block_size", DEFAULT_BLOCK_SIZE)))


def _abstract(cfg: Eagle3Config, dtype):
    model = nnx.eval_shape(lambda: Eagle3Drafter(cfg, dtype=jnp.dtype(dtype), rngs=nnx.Rngs(0)))
    return nnx.split(model)


def vocab_map_from(d2t: np.ndarray, t2d: np.ndarray | None, cfg: Eagle3Config, where: str) -> np.ndarray:
    """The target id of every draft id from the checkpoint's `d2t` offsets, checked against `t2d`."""
    ids = np.arange(cfg.draft_vocab_size) + np.asarray(d2t).astype(np.int64)
    if d2t.shape != (cfg.draft_vocab_size,) or ids.min() < 0 or ids.max() >= cfg.vocab_size:
        raise CheckpointError(f"{where}: 'd2t' maps draft ids outside the target vocabulary "
                              f"(shape {list(d2t.shape)}, draft_vocab_size={cfg.draft_vocab_size})")
    if len(np.unique(ids)) != len(ids):
        raise CheckpointError(f"{where}: 'd2t' maps two draft ids to one target id")
    if t2d is not None:
        want = np.zeros(cfg.vocab_size, bool)
        want[ids] = True
        if t2d.shape != want.shape or not np.array_equal(t2d.astype(bool), want):
            raise CheckpointError(f"{where}: 't2d' does not mark exactly the target ids 'd2t' maps to")
    return ids.astype(np.int32)


def load_eagle3(draft_dir: str, target_cfg, dtype="float32", mesh: Mesh | None = None,
                mesh_rules: MeshRules = DEFAULT_RULES) -> LoadedModel:
    """Loads an EAGLE-3 directory; refuses (one `ConfigError` line) a drafter whose hidden size,
    vocabulary or taps do not fit `target_cfg` before reading any tensor, and checkpoints with
    missing, misshapen or unexpected tensors."""
    d = read_config_json(draft_dir)
    cfg = eagle3_config(d, target_cfg.num_hidden_layers)
    check_fits_target(cfg, target_cfg)
    reader = CheckpointReader(draft_dir)
    cfg = dataclasses.replace(cfg, own_embeddings="embed_tokens.weight" in reader)
    mesh = mesh or make_mesh()
    graphdef, abstract = _abstract(cfg, dtype)
    param_abs, map_abs = abstract.filter(nnx.Param), abstract.filter(DraftVocab)
    loaded, used = load_params(param_abs, reader, mesh, dtype, rules=EAGLE3_NAME_RULES, mesh_rules=mesh_rules)
    d2t = reader.array("d2t") if "d2t" in reader else np.zeros(cfg.draft_vocab_size, np.int64)
    t2d = reader.array("t2d") if "t2d" in reader else None
    ids = vocab_map_from(d2t, t2d, cfg, draft_dir)
    unexpected = [k for k in reader.keys() if k not in used and k not in VOCAB_MAPS
                  and not k.endswith(IGNORED_SUFFIXES)]
    if unexpected:
        raise CheckpointError(f"{draft_dir}: unexpected tensors for {ARCHITECTURE}: {', '.join(sorted(unexpected)[:5])}")
    vocab = jax.tree.map(lambda _: jax.device_put(ids, replicated(mesh)), map_abs)
    return LoadedModel(cfg, graphdef, nnx.merge_state(loaded, vocab), mesh, draft_dir)


def init_eagle3(cfg: Eagle3Config, dtype="float32", mesh: Mesh | None = None, seed: int = 0,
                mesh_rules: MeshRules = DEFAULT_RULES) -> LoadedModel:
    """Random init placed at the mesh shardings (the identity draft vocabulary)."""
    mesh = mesh or make_mesh()
    graphdef, abstract = _abstract(cfg, dtype)
    make = jax.jit(lambda: nnx.split(Eagle3Drafter(cfg, dtype=jnp.dtype(dtype), rngs=nnx.Rngs(seed)))[1],
                   out_shardings=state_shardings(abstract, mesh, mesh_rules))
    return LoadedModel(cfg, graphdef, make(), mesh)


def with_draft_vocab(loaded: LoadedModel, target_ids: np.ndarray) -> LoadedModel:
    """`loaded` with the draft vocabulary `target_ids` (the target id of each draft id)."""
    ids = vocab_map_from(np.asarray(target_ids) - np.arange(loaded.cfg.draft_vocab_size), None, loaded.cfg, "draft vocab")
    params, vocab = loaded.state.filter(nnx.Param), loaded.state.filter(DraftVocab)
    vocab = jax.tree.map(lambda x: jax.device_put(ids, x.sharding), vocab)
    return dataclasses.replace(loaded, state=nnx.merge_state(params, vocab))


def save_eagle3(loaded: LoadedModel, out_dir: str, dtype=None, max_shard_bytes: int = 2 << 30):
    """Writes `config.json` and safetensors in the published layout (`d2t` int64, `t2d` bool)."""
    cfg: Eagle3Config = loaded.cfg
    tensors = export_tensors(loaded.state.filter(nnx.Param), rules=EAGLE3_NAME_RULES, dtype=dtype)
    ids = np.asarray(jax.device_get(jax.tree.leaves(loaded.state.filter(DraftVocab))[0])).astype(np.int64)
    tensors["d2t"] = ids - np.arange(cfg.draft_vocab_size)
    t2d = np.zeros(cfg.vocab_size, bool)
    t2d[ids] = True
    tensors["t2d"] = t2d
    os.makedirs(out_dir, exist_ok=True)
    write_sharded(out_dir, tensors, max_shard_bytes)
    hf = cfg.to_hf_dict()
    hf["torch_dtype"] = np.dtype(jnp.dtype(dtype or jax.tree.leaves(loaded.state.filter(nnx.Param))[0].dtype)).name
    with open(os.path.join(out_dir, "config.json"), "w") as fh:
        json.dump(hf, fh, indent=2)
