"""HF safetensors <-> NNX param trees, through a regex name table per model family.

Our kernels are `[in, out]` (HF's `[out, in]` transposed); MoE experts are stacked `[E, ...]` from
per-expert or fused HF tensors, whichever the checkpoint holds; a scanned target's
`stacks.{s}.{j}.*` `[G, ...]` map to their G per-layer names, so the files equal an unrolled
target's. Image-text checkpoints keep the text model under `model.language_model.*` (vision
ignored). Loading goes tensor by tensor and shard by shard over memory-mapped files, so no device
or host holds a whole model it does not own."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from dmtp_jax.checkpoint.gemma_names import GEMMA_IGNORED_PREFIXES, gemma_target_rules
from dmtp_jax.checkpoint.mla_names import is_nextn_tensor, mla_target_rules
from dmtp_jax.checkpoint.safetensors_io import CheckpointError, CheckpointReader, write_sharded
from dmtp_jax.config import TargetConfig, load_target_config
from dmtp_jax.models import build_target
from dmtp_jax.models.layer_stack import STACK_PATH, stack_layer_ids
from dmtp_jax.sharding import DEFAULT_RULES, MeshRules, at_shardings, make_mesh, state_shardings

# (regex on our dotted param path, HF name template, how: "copy" | "T" (swap the last two axes))
# A 3-D param whose rule is "T" is an expert stack: per-expert tensors or the fused ones.
QWEN_NAME_RULES = (
    (r"embed_tokens", "model.embed_tokens.weight", "copy"),
    (r"lm_head", "lm_head.weight", "T"),
    (r"norm", "model.norm.weight", "copy"),
    (r"layers\.(\d+)\.(input_layernorm|post_attention_layernorm)", r"model.layers.\1.\2.weight", "copy"),
    (r"layers\.(\d+)\.self_attn\.([qkvo])_proj", r"model.layers.\1.self_attn.\2_proj.weight", "T"),
    (r"layers\.(\d+)\.self_attn\.([qkvo])_bias", r"model.layers.\1.self_attn.\2_proj.bias", "copy"),
    (r"layers\.(\d+)\.self_attn\.([qk])_norm", r"model.layers.\1.self_attn.\2_norm.weight", "copy"),
    (r"layers\.(\d+)\.mlp\.router", r"model.layers.\1.mlp.gate.weight", "T"),
    (r"layers\.(\d+)\.mlp\.(gate|up|down)_proj", r"model.layers.\1.mlp.\2_proj.weight", "T"),
    (r"layers\.(\d+)\.mlp\.shared_expert\.(gate|up|down)_proj",
     r"model.layers.\1.mlp.shared_expert.\2_proj.weight", "T"),
    (r"layers\.(\d+)\.mlp\.shared_expert_gate", r"model.layers.\1.mlp.shared_expert_gate.weight", "T"),
    (r"layers\.(\d+)\.linear_attn\.(in_proj_qkvz?|in_proj_z|in_proj_ba?|in_proj_a|out_proj)",
     r"model.layers.\1.linear_attn.\2.weight", "T"),
    (r"layers\.(\d+)\.linear_attn\.(conv1d|norm)", r"model.layers.\1.linear_attn.\2.weight", "copy"),
    (r"layers\.(\d+)\.linear_attn\.(A_log|dt_bias)", r"model.layers.\1.linear_attn.\2", "copy"),
)
EXPERT_TEMPLATE = re.compile(r"^(.*layers\.\d+\.mlp\.)(gate|up|down)_proj\.weight$")
TEXT_PREFIX, IMAGE_TEXT_PREFIX = "model.", "model.language_model."
# Tensors a target directory may carry that the target itself does not use.
IGNORED_PREFIXES = ("mtp.", "model.visual.") + GEMMA_IGNORED_PREFIXES
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def target_rules(cfg: TargetConfig):
    """The name table of `cfg`'s family (the MLA families and Gemma 4 add theirs, `checkpoint/mla_names.py`,
    `checkpoint/gemma_names.py`)."""
    if cfg.gemma is not None:
        return gemma_target_rules(QWEN_NAME_RULES)
    return mla_target_rules(QWEN_NAME_RULES) if cfg.is_mla else QWEN_NAME_RULES


def image_text_rules(rules=QWEN_NAME_RULES):
    """The same table for the released image-text layout (`model.language_model.*`)."""
    return tuple((p, IMAGE_TEXT_PREFIX + t[len(TEXT_PREFIX):] if t.startswith(TEXT_PREFIX) else t, how)
                 for p, t, how in rules)


@dataclasses.dataclass(frozen=True)
class TensorSource:
    """Where one of our params lives in an HF checkpoint: one tensor, or a grid stacked along our leading
    axes `stack` (row-major names: `[E]`, `[G]` or `[G, E]`)."""
    hf_names: tuple[str, ...]
    transpose: bool                # HF's last two axes are ours swapped
    rows: tuple[int, int] | None = None   # a row range of HF's axis -2 (fused gate | up experts)
    stack: tuple[int, ...] = ()    # our leading axes that index `hf_names`

    def hf_shape(self, our_shape) -> tuple[int, ...]:
        """The HF tensor's shape for our param's shape (the row range's size on axis -2)."""
        shape = list(our_shape[len(self.stack):])
        if self.transpose:
            shape[-2:] = shape[-2:][::-1]
        return tuple(shape)

    def shape_ok(self, got, our_shape) -> bool:
        want = self.hf_shape(our_shape)
        if self.rows is None:
            return tuple(got) == want
        return (len(got) == len(want) and got[-2] >= self.rows[1] and tuple(got[:-2]) == want[:-2]
                and got[-1] == want[-1])


def _expert_source(path: str, expanded: str, shape, prefix: str, reader) -> TensorSource:
    """An expert stack `[E, ...]`: per-expert tensors, or the fused `experts.gate_up_proj` /
    `experts.down_proj` when the checkpoint has them."""
    e = EXPERT_TEMPLATE.match(expanded)
    if not e:
        raise CheckpointError(f"no expert naming rule for param '{path}'")
    base, which = prefix + e.group(1), e.group(2)
    names = tuple(f"{base}experts.{i}.{which}_proj.weight" for i in range(shape[0]))
    if reader is None or names[0] in reader:
        return TensorSource(names, True, stack=(shape[0],))
    if which == "down":
        return TensorSource((f"{base}experts.down_proj",), True)
    inter = shape[2]
    rows = (0, inter) if which == "gate" else (inter, 2 * inter)
    return TensorSource((f"{base}experts.gate_up_proj",), True, rows)


def resolve_source(path: str, shape, rules=QWEN_NAME_RULES, prefix: str = "", reader=None,
                   layer_ids: dict | None = None) -> TensorSource:
    """Maps our dotted param path (e.g. `layers.0.self_attn.q_proj`) to its HF tensor(s); with a
    `reader`, expert stacks follow the checkpoint's layout. A scanned `stacks.{s}.{j}.*` stands for
    the layers `layer_ids[(s, j)]`, stacked on axis 0.

    Example:
        >>> resolve_source("stacks.0.1.mlp.up_proj", (2, 4, 8), layer_ids={(0, 1): (1, 3)}).hf_names
        ('model.layers.1.mlp.up_proj.weight', 'model.layers.3.mlp.up_proj.weight')
    """
    m = STACK_PATH.fullmatch(path)
    if m and layer_ids is not None:
        parts = [resolve_source(f"layers.{i}.{m.group(3)}", shape[1:], rules, prefix, reader)
                 for i in layer_ids[(int(m.group(1)), int(m.group(2)))]]
        return TensorSource(tuple(n for p in parts for n in p.hf_names), parts[0].transpose, parts[0].rows,
                            (len(parts),) + parts[0].stack)
    for pattern, template, how in rules:
        m = re.fullmatch(pattern, path)
        if not m:
            continue
        if how == "T" and len(shape) == 3:
            return _expert_source(path, m.expand(template), shape, prefix, reader)
        return TensorSource((prefix + m.expand(template),), how == "T")
    raise CheckpointError(f"no HF name rule for param '{path}'")


def _dotted(path) -> str:
    return ".".join(str(p) for p in path)


def _layer_ids(state: nnx.State) -> dict:
    """The layers each scanned stack member stands for, from the state's paths and shapes."""
    return stack_layer_ids((_dotted(path), var.shape) for path, var in nnx.to_flat_state(state))


def _swap_last(x):
    return np.swapaxes(x, -1, -2)


def _read_slice(reader: CheckpointReader, src: TensorSource, index, dtype) -> np.ndarray:
    """The block `index` (slices in our layout) of a param, read from the memory-mapped files."""
    def hf_index(idx):
        idx = list(idx)
        if src.transpose and len(idx) >= 2:
            idx[-2], idx[-1] = idx[-1], idx[-2]
        if src.rows is not None:
            lo, hi = src.rows
            start, stop, _ = idx[-2].indices(hi - lo)
            idx[-2] = slice(lo + start, lo + stop)
        return tuple(idx)

    n = len(src.stack)
    names = np.asarray(np.array(src.hf_names, dtype=object).reshape(src.stack)[tuple(index[:n])], dtype=object)
    parts = [reader.array(name)[hf_index(index[n:])] for name in names.flat]
    parts = [_swap_last(p) if src.transpose else p for p in parts]
    block = np.stack(parts).reshape(names.shape + parts[0].shape)
    return np.ascontiguousarray(block.astype(dtype))


def load_params(abstract_state: nnx.State, reader: CheckpointReader, mesh: Mesh, dtype,
                rules=QWEN_NAME_RULES, prefix: str = "", mesh_rules: MeshRules = DEFAULT_RULES,
                progress: Callable[[str], None] | None = None) -> tuple[nnx.State, set[str]]:
    """Fills an abstract NNX state from `reader`, each array at its mesh sharding: `(state, HF names
    consumed)`. Missing tensors and shape mismatches raise `CheckpointError` naming the tensor."""
    shardings = state_shardings(abstract_state, mesh, mesh_rules)
    np_dtype = np.dtype(jnp.dtype(dtype))
    used: set[str] = set()
    loaded = []
    layer_ids = _layer_ids(abstract_state)
    for (path, var), (_, shard_var) in zip(nnx.to_flat_state(abstract_state), nnx.to_flat_state(shardings)):
        dotted = _dotted(path)
        src = resolve_source(dotted, var.shape, rules, prefix, reader, layer_ids)
        for name in src.hf_names:
            if name not in reader:
                raise CheckpointError(f"{reader.model_dir}: missing tensor '{name}' (for param '{dotted}')")
            got = reader.shape(name)
            want = src.hf_shape(var.shape)
            if not src.shape_ok(got, var.shape):
                raise CheckpointError(f"{reader.model_dir}: tensor '{name}' has shape {list(got)}, "
                                      f"expected {list(want)} from config.json")
        if progress:
            progress(dotted)
        arr = jax.make_array_from_callback(
            tuple(var.shape), shard_var.get_value(),
            lambda index, src=src: _read_slice(reader, src, index, np_dtype))
        used.update(src.hf_names)
        loaded.append((path, var.replace(arr)))
    return nnx.from_flat_state(loaded), used


def export_tensors(state: nnx.State, rules=QWEN_NAME_RULES, prefix: str = "", dtype=None) -> dict[str, np.ndarray]:
    """HF-named numpy tensors of a (possibly sharded) state; gathers one param at a time."""
    out = {}
    layer_ids = _layer_ids(state)
    for path, var in nnx.to_flat_state(state):
        value = np.asarray(jax.device_get(var.get_value()))
        if dtype is not None:
            value = value.astype(np.dtype(jnp.dtype(dtype)))
        src = resolve_source(_dotted(path), value.shape, rules, prefix, layer_ids=layer_ids)
        for name, index in zip(src.hf_names, np.ndindex(*src.stack)):
            out[name] = _swap_last(value[index]) if src.transpose else value[index]
    return out


@dataclasses.dataclass
class LoadedModel:
    """A model ready for jitted functions (`nnx.merge(graphdef, state)` inside the jit); `cfg` is its
    config dataclass."""
    cfg: Any
    graphdef: nnx.GraphDef
    state: nnx.State
    mesh: Mesh
    model_dir: str | None = None

    @property
    def state_dtype(self):
        return jax.tree.leaves(self.state)[0].dtype


LoadedTarget = LoadedModel      # cfg: TargetConfig


def abstract_target(cfg: TargetConfig, dtype, scan_layers: bool = True, mesh_rules: MeshRules = DEFAULT_RULES):
    """(graphdef, abstract state) without allocating any parameter (`scan_layers=False`: unrolled),
    for placing with `mesh_rules`."""
    model = nnx.eval_shape(lambda: build_target(cfg, jnp.dtype(dtype), nnx.Rngs(0), scan_layers, mesh_rules))
    return nnx.split(model)


def place_abstract(cfg, graphdef, abstract: nnx.State, mesh: Mesh, source: str | None = None,
                   mesh_rules: MeshRules = DEFAULT_RULES) -> LoadedModel:
    """A weightless `LoadedModel`: every state leaf a `jax.ShapeDtypeStruct` at its mesh sharding, which
    jitted functions lower and compile as they would the loaded model."""
    return LoadedModel(cfg, graphdef, at_shardings(abstract, state_shardings(abstract, mesh, mesh_rules)), mesh,
                       source)


def load_target(model_dir: str, dtype="float32", mesh: Mesh | None = None,
                mesh_rules: MeshRules = DEFAULT_RULES, scan_layers: bool = True) -> LoadedTarget:
    """Loads an HF target directory into sharded params."""
    cfg = load_target_config(model_dir)
    mesh = mesh or make_mesh()
    graphdef, abstract = abstract_target(cfg, dtype, scan_layers, mesh_rules)
    reader = CheckpointReader(model_dir)
    image_text = f"{IMAGE_TEXT_PREFIX}embed_tokens.weight" in reader
    rules = image_text_rules(target_rules(cfg)) if image_text else target_rules(cfg)
    state, used = load_params(abstract, reader, mesh, dtype, rules=rules, mesh_rules=mesh_rules)
    unexpected = [k for k in reader.keys() if k not in used and not k.startswith(IGNORED_PREFIXES)
                  and not k.endswith(IGNORED_SUFFIXES)
                  and not (cfg.is_mla and is_nextn_tensor(k, cfg.num_hidden_layers))
                  and not (cfg.tie_word_embeddings and k == "lm_head.weight")]
    if unexpected:
        more = f" (and {len(unexpected) - 5} more)" if len(unexpected) > 5 else ""
        raise CheckpointError(f"{model_dir}: unexpected tensors for {cfg.model_type}: "
                              f"{', '.join(sorted(unexpected)[:5])}{more}")
    return LoadedTarget(cfg, graphdef, state, mesh, model_dir)


def init_target(cfg: TargetConfig, dtype="float32", mesh: Mesh | None = None, seed: int = 0,
                mesh_rules: MeshRules = DEFAULT_RULES, scan_layers: bool = True) -> LoadedTarget:
    """Random init placed directly at the mesh shardings (one jit, no host copy)."""
    mesh = mesh or make_mesh()
    graphdef, abstract = abstract_target(cfg, dtype, scan_layers, mesh_rules)
    shardings = state_shardings(abstract, mesh, mesh_rules)
    make = jax.jit(lambda: nnx.split(build_target(cfg, jnp.dtype(dtype), nnx.Rngs(seed), scan_layers,
                                                  mesh_rules))[1],
                   out_shardings=shardings)
    return LoadedTarget(cfg, graphdef, make(), mesh)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "generation_config.json", "chat_template.jinja")


def save_target(target: LoadedTarget, out_dir: str, dtype=None, max_shard_bytes: int = 2 << 30,
                extra_tensors: dict[str, np.ndarray] | None = None, copy_files_from: str | None = None):
    """Writes `config.json` + safetensors (sharded with an index past `max_shard_bytes`), `extra_tensors`
    (e.g. `mtp.*`) alongside, tokenizer and generation files copied from `copy_files_from`."""
    tensors = export_tensors(target.state, rules=target_rules(target.cfg), dtype=dtype)
    tensors.update(extra_tensors or {})
    os.makedirs(out_dir, exist_ok=True)
    write_sharded(out_dir, tensors, max_shard_bytes)
    hf_cfg = target.cfg.to_hf_dict()
    saved_dtype = np.dtype(jnp.dtype(dtype or target.state_dtype)).name
    hf_cfg["dtype"] = saved_dtype
    with open(os.path.join(out_dir, "config.json"), "w") as fh:
        json.dump(hf_cfg, fh, indent=2)
    if copy_files_from:
        for fname in TOKENIZER_FILES:
            src = os.path.join(copy_files_from, fname)
            if os.path.isfile(src) and os.path.abspath(src) != os.path.abspath(os.path.join(out_dir, fname)):
                shutil.copy(src, out_dir)
