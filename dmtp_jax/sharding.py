"""One mesh `("data", "fsdp", "expert", "tensor")`, logical-axis rules (`MeshRules`), placement of
params and caches. Every axis defaults to size 1; a mesh axis that does not divide a dimension is
dropped for that array (replicated). What each axis splits: docs/sizing.md.

Example:
    >>> mesh = make_mesh("tensor=1")
    >>> spec_for(("embed", "mlp"), (32, 64), mesh, DEFAULT_RULES)
    P()
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from dmtp_jax.errors import UserError

MESH_AXES = ("data", "fsdp", "expert", "tensor")


class MeshError(UserError, ValueError):
    """A mesh spec that cannot be built on the available devices."""


@dataclasses.dataclass(frozen=True)
class MeshRules:
    """Logical axis name -> mesh axes (a name, a tuple of names, or None for replicated)."""

    rules: tuple[tuple[str, Any], ...]

    def lookup(self, name: str | None):
        if name is None:
            return ()
        for key, axes in self.rules:
            if key == name:
                if axes is None:
                    return ()
                return (axes,) if isinstance(axes, str) else tuple(axes)
        return ()


DEFAULT_RULES = MeshRules((
    ("batch", ("data", "fsdp", "expert")),   # "expert" last: moe_mlp gathers / reduce-scatters over it
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("features", "tensor"),    # the input dim of the feature projections (MTP / DFlash `fc`, DMTP fusion)
    ("experts", "expert"),
    ("cache_heads", "tensor"),
    ("layers", None),          # the leading axis of scanned layer stacks (`models/layer_stack.py`)
))


def parse_mesh_spec(spec: str | None) -> dict[str, int]:
    """`"tensor=4,data=2"` -> `{"data": 2, "fsdp": 1, "expert": 1, "tensor": 4}` (unnamed axes 1);
    clear errors on bad input."""
    sizes = {a: 1 for a in MESH_AXES}
    if not spec:
        return sizes
    for part in spec.split(","):
        name, _, value = part.strip().partition("=")
        if name not in MESH_AXES:
            raise MeshError(f"unknown mesh axis '{name}' in '{spec}'; axes are {', '.join(MESH_AXES)}")
        try:
            sizes[name] = int(value)
        except ValueError:
            raise MeshError(f"mesh axis '{name}' needs an integer size, got '{value}'") from None
        if sizes[name] < 1:
            raise MeshError(f"mesh axis '{name}' must be >= 1, got {sizes[name]}")
    return sizes


def make_mesh(spec: str | dict[str, int] | None = None, devices=None) -> Mesh:
    """A mesh over the first `data*fsdp*expert*tensor` devices.

    Example:
        >>> make_mesh("tensor=1").axis_names
        ('data', 'fsdp', 'expert', 'tensor')
    """
    sizes = parse_mesh_spec(spec) if not isinstance(spec, dict) else {**parse_mesh_spec(None), **spec}
    devices = list(jax.devices() if devices is None else devices)
    need = int(np.prod([sizes[a] for a in MESH_AXES]))
    if need > len(devices):
        raise MeshError(f"mesh {sizes} needs {need} devices but only {len(devices)} are visible")
    grid = np.array(devices[:need]).reshape([sizes[a] for a in MESH_AXES])
    return Mesh(grid, MESH_AXES)


def spec_for(logical_axes, shape, mesh: Mesh, rules: MeshRules = DEFAULT_RULES) -> P:
    """PartitionSpec for an array with these logical axes; non-dividing mesh axes are dropped."""
    sizes = dict(mesh.shape)
    used: set[str] = set()
    out = []
    for name, dim in zip(logical_axes, shape):
        axes = tuple(a for a in rules.lookup(name) if a not in used and sizes.get(a, 1) > 1)
        while axes and dim % int(np.prod([sizes[a] for a in axes])):
            axes = axes[:-1]
        used.update(axes)
        out.append(None if not axes else (axes[0] if len(axes) == 1 else axes))
    while out and out[-1] is None:
        out.pop()
    return P(*out)


def named_sharding(logical_axes, shape, mesh: Mesh, rules: MeshRules = DEFAULT_RULES) -> NamedSharding:
    return NamedSharding(mesh, spec_for(logical_axes, shape, mesh, rules))


def state_shardings(abstract_state: nnx.State, mesh: Mesh, rules: MeshRules = DEFAULT_RULES):
    """NamedSharding tree matching an (abstract) NNX state whose params carry `logical_axes`."""
    def one(var):
        axes = var.get_metadata().get("logical_axes") or (None,) * len(var.shape)
        return var.replace(named_sharding(axes, var.shape, mesh, rules))
    return jax.tree.map(one, abstract_state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def at_shardings(shapes, shardings):
    """`ShapeDtypeStruct`s of a tree of shapes, each at its sharding from a tree of the same structure
    (abstract arguments to lower a jitted function with: nothing allocated).

    Example:
        >>> w = at_shardings({"w": jax.ShapeDtypeStruct((2,), np.float32)}, {"w": replicated(make_mesh())})["w"]
        >>> w.shape, w.sharding.spec
        ((2,), P())
    """
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), shapes, shardings)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def gathered_over(shardings, axis: str):
    """The same tree of `NamedSharding`s with mesh axis `axis` dropped from every spec: what FSDP
    gathers a weight to at its use (the transpose of the constraint reduce-scatters its gradient).

    Example:
        >>> mesh = make_mesh("fsdp=1")
        >>> gathered_over({"w": NamedSharding(mesh, P(("data", "fsdp"), "tensor"))}, "fsdp")["w"].spec
        P('data', 'tensor')
    """
    def drop(entry):
        if entry == axis:
            return None
        if isinstance(entry, tuple):
            kept = tuple(a for a in entry if a != axis)
            return kept[0] if len(kept) == 1 else (kept or None)
        return entry
    return jax.tree.map(lambda s: NamedSharding(s.mesh, P(*(drop(e) for e in s.spec))), shardings)


def batch_sharding(mesh: Mesh, shape, batch_axis: int = 0, rules: MeshRules = DEFAULT_RULES) -> NamedSharding:
    """Shards dimension `batch_axis` over the batch mesh axes (when they divide it)."""
    axes = [None] * len(shape)
    axes[batch_axis] = "batch"
    return named_sharding(axes, shape, mesh, rules)


def recurrent_state_sharding(mesh: Mesh, shape, rules: MeshRules = DEFAULT_RULES) -> NamedSharding:
    """DeltaNet state `[layers, batch, ...]`: batch over the batch axes (data, fsdp, expert); a 5-D recurrent state
    `[L, B, nv, dk, dv]` also splits its value heads over tensor (a conv window stays whole)."""
    axes = ((None, "batch", "cache_heads", None, None) if len(shape) == 5
            else (None, "batch") + (None,) * (len(shape) - 2))
    return named_sharding(axes, shape, mesh, rules)


def cache_kv_heads(num_kv_heads: int, num_heads: int, mesh: Mesh | None, rules: MeshRules = DEFAULT_RULES) -> int:
    """KV heads a cache holds on `mesh`: the model's, or -- when the mesh axes of `"cache_heads"`
    (`tensor`) are wider than the KV heads and split the query heads -- one (repeated) KV head per
    shard, so that each device holds only the heads its queries read instead of all of them
    (Qwen3.6-27B: 4 KV heads on `tensor=8` -> 8 cache heads, a quarter of the cache per device
    instead of all of it).

    Example:
        >>> cache_kv_heads(4, 24, None), cache_kv_heads(4, 24, make_mesh("tensor=1"))
        (4, 4)
    """
    if mesh is None:
        return num_kv_heads
    sizes = dict(mesh.shape)
    width = int(np.prod([sizes.get(a, 1) for a in rules.lookup("cache_heads")]))
    if width > num_kv_heads and width % num_kv_heads == 0 and num_heads % width == 0:
        return width
    return num_kv_heads


def kv_cache_sharding(mesh: Mesh, shape, rules: MeshRules = DEFAULT_RULES) -> NamedSharding:
    """`[layers, batch, max_len, kv_heads, head_dim]`: batch over the batch axes (data, fsdp, expert),
    heads over tensor."""
    return named_sharding((None, "batch", None, "cache_heads", None), shape, mesh, rules)


def weights_mesh(w: jax.Array):
    """The mesh `w` is placed on (abstract inside jit), else the context mesh; None if neither."""
    mesh = getattr(getattr(jax.typeof(w), "sharding", None), "mesh", None)
    if mesh is None or mesh.empty:
        mesh = jax.sharding.get_abstract_mesh()
    return None if mesh is None or mesh.empty or mesh.size <= 1 else mesh


def mesh_axes(entry) -> tuple[str, ...]:
    """A `PartitionSpec` entry as a tuple of mesh axis names."""
    return () if entry is None else ((entry,) if isinstance(entry, str) else tuple(entry))
