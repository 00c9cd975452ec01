"""The target's decoder layers as scanned stacks: program size and compile time flat in depth. A
stack is `repeats` copies of a group of `period` layers, params `[repeats, ...]`, run as one
`jax.lax.scan` (carry: hidden, caches, capture buffer; docs/models-detail.md). `plan_stacks` picks them.

Example:
    >>> from dmtp_jax.config import TargetConfig
    >>> cfg = TargetConfig.from_hf_dict({"model_type": "qwen3_5", "vocab_size": 64, "hidden_size": 16,
    ...     "intermediate_size": 32, "num_hidden_layers": 8, "num_attention_heads": 2,
    ...     "num_key_value_heads": 1, "head_dim": 8, "linear_num_key_heads": 1,
    ...     "linear_num_value_heads": 2, "linear_key_head_dim": 8, "linear_value_head_dim": 8})
    >>> [(s.start, s.period, s.repeats) for s in plan_stacks(cfg)]
    [(0, 4, 2)]
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dmtp_jax import platform
from dmtp_jax.layers.kv_cache import PendingBlock

STACKS_ATTR = "stacks"                      # QwenTarget's attribute holding the stacks
STACK_PATH = re.compile(r"stacks\.(\d+)\.(\d+)\.(.+)")


@dataclasses.dataclass(frozen=True)
class StackSpec:
    """`repeats` groups of `period` layers from layer `start`; member `j` of group `g` is layer
    `start + g * period + j`. `attn_start` / `linear_start`: the cache indices of the first group's
    first attention / DeltaNet layer; `kinds[j]`: member `j`'s (layer type, is MoE)."""
    start: int
    period: int
    repeats: int
    kinds: tuple[tuple[str, bool], ...]
    attn_start: int
    linear_start: int

    @property
    def linear_members(self) -> tuple[int, ...]:
        return tuple(j for j, (t, _) in enumerate(self.kinds) if t == "linear_attention")

    @property
    def attn_members(self) -> tuple[int, ...]:
        return tuple(j for j, (t, _) in enumerate(self.kinds) if t != "linear_attention")

    def layer_ids(self, j: int) -> tuple[int, ...]:
        """The layers member `j` stands for, one per group."""
        return tuple(range(self.start + j, self.start + self.period * self.repeats, self.period))


def _stacks_for_period(kinds, period: int) -> list[tuple[int, int, int]]:
    """`(start, period, repeats)` runs of equal consecutive blocks of `period` layers (the last
    block may be shorter)."""
    blocks = [(i, tuple(kinds[i:i + period])) for i in range(0, len(kinds), period)]
    runs: list[list] = []
    for start, block in blocks:
        if runs and runs[-1][1] == block:
            runs[-1][2] += 1
        else:
            runs.append([start, block, 1])
    return [(start, len(block), repeats) for start, block, repeats in runs]


def plan_stacks(cfg, scan: bool = True) -> tuple[StackSpec, ...]:
    """The stacks of `cfg`'s layers: the period with the fewest layer bodies in all (ties: fewer
    stacks, then the shorter period); `scan=False`: one stack of every layer (the unrolled loop)."""
    n = cfg.num_hidden_layers
    kinds = [(cfg.layer_types[i], bool(cfg.is_moe_layer(i))) for i in range(n)]
    if scan:
        runs = min((_stacks_for_period(kinds, p) for p in range(1, n + 1)),
                   key=lambda rs: (sum(period for _, period, _ in rs), len(rs), rs[0][1]))
    else:
        runs = [(0, n, 1)]
    out, attn, linear = [], 0, 0
    for start, period, repeats in runs:
        spec = StackSpec(start, period, repeats, tuple(kinds[start:start + period]), attn, linear)
        out.append(spec)
        attn += len(spec.attn_members) * repeats
        linear += len(spec.linear_members) * repeats
    return tuple(out)


def stacked(make_group: Callable[[nnx.Rngs], nnx.List], repeats: int, rngs: nnx.Rngs) -> nnx.List:
    """`make_group`'s modules with every param stacked `[repeats, ...]` (one random draw per
    group, vmapped: one trace whatever `repeats`) and "layers" prepended to its logical axes."""
    graphdef = nnx.split(nnx.eval_shape(lambda: make_group(nnx.Rngs(0))))[0]
    keys = jax.random.split(rngs.params(), repeats)
    state = jax.vmap(lambda key: nnx.split(make_group(nnx.Rngs(key)))[1])(keys)

    def lead(var):
        axes = var.get_metadata().get("logical_axes") or (None,) * (var.ndim - 1)
        return var.replace(logical_axes=("layers", *axes))
    return nnx.merge(graphdef, jax.tree.map(lead, state, is_leaf=lambda x: isinstance(x, nnx.Variable)))


def stack_layer_ids(flat_paths_shapes) -> dict[tuple[int, int], tuple[int, ...]]:
    """`{(stack, member): layer ids}` from a state's `(dotted path, shape)` pairs alone: a stack's
    period is its member count, its repeats the leading dim, its start the layers before it."""
    period: dict[int, int] = {}
    repeats: dict[int, int] = {}
    for path, shape in flat_paths_shapes:
        m = STACK_PATH.fullmatch(path)
        if m:
            s, j = int(m.group(1)), int(m.group(2))
            period[s] = max(period.get(s, 0), j + 1)
            repeats[s] = int(shape[0])
    out, start = {}, 0
    for s in sorted(period):
        for j in range(period[s]):
            out[(s, j)] = tuple(range(start + j, start + period[s] * repeats[s], period[s]))
        start += period[s] * repeats[s]
    return out


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Carry:
    """What flows from layer to layer (None: not in this call)."""
    x_bth: jax.Array
    kv: object                      # KVCache | None
    conv_lbwc: jax.Array | None
    ssm_lbhkv: jax.Array | None
    captured_nbth: jax.Array | None   # [n_capture + 1, B, T, H]


@dataclasses.dataclass(frozen=True)
class Context:
    """Per-call inputs every layer reads."""
    positions_bt: jax.Array
    cos: jax.Array
    sin: jax.Array
    kv_valid_bt: jax.Array | None
    speculative: bool


def capture_slots(spec: StackSpec, capture_layers: tuple[int, ...]) -> np.ndarray:
    """`[repeats, period]` capture-buffer slot per layer: its place among the distinct captured
    layers, else the dummy slot `n_capture`."""
    order = {i: k for k, i in enumerate(dict.fromkeys(capture_layers))}
    dummy = len(order)
    return np.array([[order.get(spec.start + g * spec.period + j, dummy) for j in range(spec.period)]
                     for g in range(spec.repeats)], np.int32)


def run_layer(layer, carry: Carry, ctx: Context, kv_index, linear_index):
    """One decoder layer on the carry. Returns `(carry, pending block or None)`. An attention layer
    reads / writes K/V at `kv_index`; a DeltaNet layer its conv window and state at
    `linear_index` (each a Python int or a traced scalar)."""
    x = carry.x_bth
    if not layer.is_linear:
        x, kv = layer(x, ctx.positions_bt, ctx.cos, ctx.sin, carry.kv, ctx.kv_valid_bt, kv_index)
        return dataclasses.replace(carry, x_bth=x.astype(carry.x_bth.dtype), kv=kv), None
    conv, ssm = carry.conv_lbwc, carry.ssm_lbhkv
    speculative = ctx.speculative and ssm is not None
    with jax.named_scope("linear_attention"):
        y, (c, s), block = layer.linear_attn(
            layer.norm(x, layer.input_layernorm), None if conv is None else conv[linear_index],
            None if ssm is None else ssm[linear_index], ctx.kv_valid_bt, speculative=speculative)
    if block is None and ssm is not None:
        conv, ssm = conv.at[linear_index].set(c), ssm.at[linear_index].set(s)
    x = layer.finish(x, y).astype(carry.x_bth.dtype)
    return dataclasses.replace(carry, x_bth=x, conv_lbwc=conv, ssm_lbhkv=ssm), block


def run_stack(spec: StackSpec, members: nnx.List, carry: Carry, ctx: Context,
              capture_layers: tuple[int, ...]) -> tuple[Carry, list]:
    """Runs a stack's groups over the carry (a scan when `repeats > 1`). Returns the carry and the
    stack's pending blocks in linear-layer order (a list of `PendingBlock` parts `[n, B, T, ...]`,
    empty unless the call is speculative)."""
    graphdef, state = nnx.split(members)
    slots_gp = capture_slots(spec, capture_layers)
    n_attn, n_linear = len(spec.attn_members), len(spec.linear_members)

    def group(carry: Carry, xs):
        state_g, g, slots_p = xs
        layers = nnx.merge(graphdef, state_g)
        blocks, a, lin = [], 0, 0
        for j, layer in enumerate(layers):
            with jax.named_scope(f"layer_{spec.start + j}" if spec.repeats == 1 else f"member_{j}"):
                carry, block = run_layer(layer, carry, ctx, spec.attn_start + g * n_attn + a,
                                         spec.linear_start + g * n_linear + lin)
            if layer.is_linear:
                lin += 1
            else:
                a += 1
            if block is not None:
                blocks.append(block)
            if carry.captured_nbth is not None:
                carry = dataclasses.replace(carry, captured_nbth=jax.lax.dynamic_update_index_in_dim(
                    carry.captured_nbth, carry.x_bth, slots_p[j], 0))
        parts = tuple(jnp.stack(p) for p in zip(*blocks)) if blocks else ()
        return carry, parts

    if spec.repeats == 1:                       # static indices, no loop
        carry, parts = group(carry, (jax.tree.map(lambda v: v[0], state), 0, tuple(slots_gp[0])))
        return carry, list(parts)
    carry, parts = jax.lax.scan(group, carry, (state, jnp.arange(spec.repeats), jnp.asarray(slots_gp)),
                                unroll=platform.layers_unrolled())
    return carry, [p.reshape((-1,) + p.shape[2:]) for p in parts]


def run_stacks(specs, stacks, x_bth, kv, conv_lbwc, ssm_lbhkv, ctx: Context, capture_layers=()):
    """Every stack in order. Returns `(carry, pending)`: the last layer's output, the caches, the
    capture buffer, and the speculative `PendingBlock` (None unless one was left)."""
    n_capture = len(dict.fromkeys(capture_layers))
    buf = (jnp.zeros((n_capture + 1,) + x_bth.shape, x_bth.dtype) if capture_layers else None)
    carry = Carry(x_bth, kv, conv_lbwc, ssm_lbhkv, buf)
    pending = []
    for spec, members in zip(specs, stacks):
        carry, parts = run_stack(spec, members, carry, ctx, tuple(capture_layers))
        if parts:
            pending.append(parts)
    block = (PendingBlock(*(jnp.concatenate(p) if len(p) > 1 else p[0] for p in zip(*pending)))
             if pending else None)
    return carry, block


def captured_outputs(carry: Carry, capture_layers, last_layer: int, hidden_bth):
    """The captured layers' outputs in `capture_layers` order (the last layer's: `hidden_bth`,
    the post-norm state, as HF's `hidden_states[L]`)."""
    order = {i: k for k, i in enumerate(dict.fromkeys(capture_layers))}
    return tuple(hidden_bth if i == last_layer else carry.captured_nbth[order[i]] for i in capture_layers)
