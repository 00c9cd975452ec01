"""SwiGLU MLP and the Qwen3-MoE / Qwen3.5-MoE sparse block, computed only for the routed experts.

Router (same as transformers' Qwen3MoeTopKRouter): softmax over experts in fp32, top-k, optional
renormalisation of the k weights, weights cast to the activation dtype. Expert `e` computes
`down_e(silu(x @ gate_e) * (x @ up_e))`; a token's output is `sum_k weight_k * y_{e_k}`.

`moe_mlp` computes only the N*k routed (token, expert) pairs: the assignments are sorted by expert,
the tokens gathered into that order, the three expert matmuls run as a grouped matmul over the
per-expert group sizes, and the rows are unsorted and weighted back into `[N, H]`. Shapes are fixed
(N*k rows), so it jits, and it is differentiable. Grouped-matmul kernels (`impl`):

- `"ragged"`: `jax.lax.ragged_dot`. A real grouped GEMM on TPU; on CPU (and, unless XLA has a native
  kernel, GPU) XLA expands it into a masked dense dot over every group, i.e. E times the work.
- `"blocked"`: portable. Each expert's rows are padded to a multiple of a block of B rows (B chosen
  from N*k/E), each block gathers its expert's weights, and one batched matmul runs over the blocks.
  Work is at most `N*k + min(E, N*k)*B` rows, nearly independent of E (B=1 at decode: exactly the
  k routed experts' weights are read per token).
- `"scan"`: the same blocks, computed by a `lax.scan` that slices each block's expert weights
  instead of gathering copies and skips the unused tail blocks at run time (~5x faster than
  `"blocked"` on CPU at 256 experts; under expert parallelism a shard only computes its own rows,
  while `"blocked"` always pays for the static worst case, all N*k rows, on every shard).
- `"auto"` (default): `"ragged"` on TPU, `"blocked"` on GPU, `"scan"` on CPU (`AUTO_IMPL`). The GPU
  choice is unmeasured (no GPU here); pass `impl=` to compare.

Expert parallelism. When the weights live on a mesh with more than one device, the routed part runs
under `jax.shard_map` over that mesh: expert weights are split over the mesh axes of the logical
`"experts"` axis (`"expert"`, see `dmtp_jax.sharding`) and their intermediate dim over those of
`"mlp"` (`"tensor"`); tokens are split over the batch axes (`"data"`, `"fsdp"`) and replicated over
`expert`/`tensor`. Each shard computes the assignments routed to its local experts on its local
tokens and the partial outputs are summed (`psum`) over the expert and tensor axes. Axes that do not
divide a dimension are left out, like `dmtp_jax.sharding.spec_for` does when placing params.
Not meant to be called inside another `shard_map` (manual mesh axes).

How the mesh is found: from the (abstract) mesh of the expert weights' sharding,
`jax.typeof(gate_ehi).sharding.mesh`, which inside `jax.jit` is the mesh of the NamedShardings the
params were placed with (`dmtp_jax.sharding.state_shardings`), or else from the context mesh
(`jax.set_mesh(mesh)`). Callers therefore need nothing new: pass params placed on the mesh into a
`jax.jit`-ed forward. Plain, uncommitted arrays or a 1-device mesh run the single-device path.

Example:
    >>> import jax, jax.numpy as jnp
    >>> ks = jax.random.split(jax.random.key(0), 5)
    >>> n, h, e, i, k = 6, 16, 8, 32, 2
    >>> x_nh = jax.random.normal(ks[0], (n, h))
    >>> router_he = jax.random.normal(ks[1], (h, e))
    >>> gate_ehi, up_ehi = (jax.random.normal(kk, (e, h, i)) * 0.1 for kk in ks[2:4])
    >>> down_eih = jax.random.normal(ks[4], (e, i, h)) * 0.1
    >>> y_nh = moe_mlp(x_nh, router_he, gate_ehi, up_ehi, down_eih, top_k=k, norm_topk_prob=True)
    >>> ref_nh = moe_mlp_dense(x_nh, router_he, gate_ehi, up_ehi, down_eih, k, True)
    >>> y_nh.shape, bool(jnp.allclose(y_nh, ref_nh, atol=1e-5))
    ((6, 16), True)
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from dmtp_jax.platform import compile_platform
from dmtp_jax.sharding import DEFAULT_RULES, spec_for

MAX_BLOCK_ROWS = 128


def swiglu(x: jax.Array, gate_hi: jax.Array, up_hi: jax.Array, down_ih: jax.Array) -> jax.Array:
    """`down(silu(gate(x)) * up(x))` with kernels stored `[in, out]`."""
    return (jax.nn.silu(x @ gate_hi) * (x @ up_hi)) @ down_ih


# ---------------------------------------------------------------------------------------------- router

def moe_top_k(x_nh: jax.Array, router_he: jax.Array, top_k: int,
              norm_topk_prob: bool) -> tuple[jax.Array, jax.Array]:
    """`(weights_nk in x dtype, experts_nk int32)`: fp32 softmax over experts, top-k, optionally
    renormalised. Same selection and weights as transformers' Qwen3MoeTopKRouter."""
    probs_ne = jax.nn.softmax((x_nh @ router_he).astype(jnp.float32), axis=-1)
    weights_nk, experts_nk = jax.lax.top_k(probs_ne, top_k)
    if norm_topk_prob:
        weights_nk = weights_nk / jnp.sum(weights_nk, axis=-1, keepdims=True)
    return weights_nk.astype(x_nh.dtype), experts_nk.astype(jnp.int32)


def moe_routing(x_nh: jax.Array, router_he: jax.Array, top_k: int, norm_topk_prob: bool) -> jax.Array:
    """Dense combine weights `[N, E]`: the `moe_top_k` weights on the selected experts, zeros elsewhere."""
    weights_nk, experts_nk = moe_top_k(x_nh, router_he, top_k, norm_topk_prob)
    onehot_nke = jax.nn.one_hot(experts_nk, router_he.shape[-1], dtype=weights_nk.dtype)
    return jnp.einsum("nk,nke->ne", weights_nk, onehot_nke)


def moe_mlp_dense(x_nh: jax.Array, router_he: jax.Array, gate_ehi: jax.Array, up_ehi: jax.Array,
                  down_eih: jax.Array, top_k: int, norm_topk_prob: bool) -> jax.Array:
    """Reference: every expert runs on every token and the combine weights zero the unselected ones
    (E/k times the work of `moe_mlp`; kept for tests and benchmarks)."""
    combine_ne = moe_routing(x_nh, router_he, top_k, norm_topk_prob)
    h = jax.nn.silu(jnp.einsum("nh,ehi->nei", x_nh, gate_ehi)) * jnp.einsum("nh,ehi->nei", x_nh, up_ehi)
    out_neh = jnp.einsum("nei,eih->neh", h, down_eih)
    return jnp.einsum("neh,ne->nh", out_neh, combine_ne)


# ------------------------------------------------------------------------------------ grouped kernels

def _ragged_expert_mlp(x_mh, group_sizes_g, gate_ghi, up_ghi, down_gih):
    """Rows of `x_mh` sorted by group; rows past `sum(group_sizes_g)` come back zero."""
    gate_mi = jax.lax.ragged_dot(x_mh, gate_ghi, group_sizes_g)
    up_mi = jax.lax.ragged_dot(x_mh, up_ghi, group_sizes_g)
    return jax.lax.ragged_dot(jax.nn.silu(gate_mi) * up_mi, down_gih, group_sizes_g)


def block_rows_for(num_rows: int, num_groups: int) -> int:
    """Rows per block of the blocked kernel: the power of two <= rows per group, in [1, 128]; so the
    padding (< one block per non-empty group) stays below about `num_rows`."""
    per_group = max(1, num_rows // max(1, num_groups))
    return min(MAX_BLOCK_ROWS, 1 << (per_group.bit_length() - 1))


def _blocked_expert_mlp(x_mh, group_sizes_g, gate_ghi, up_ghi, down_gih, *, scan: bool = False):
    """Same contract as `_ragged_expert_mlp`, without ragged_dot: groups padded to blocks of B rows,
    one expert per block. `scan=False`: one batched matmul over the blocks with per-block gathered
    weights (few big kernels: accelerators). `scan=True`: a `lax.scan` over the blocks slicing each
    block's expert weights (no weight copies: CPU)."""
    m, g = x_mh.shape[0], gate_ghi.shape[0]
    block = block_rows_for(m, g)
    # every non-empty block holds >= 1 row, and only the last block of a group is partial
    num_blocks = min(m, m // block + min(g, m))
    blocks_g = (group_sizes_g + block - 1) // block
    block_end_g = jnp.cumsum(blocks_g)
    block_start_g = block_end_g - blocks_g
    row_end_g = jnp.cumsum(group_sizes_g)
    row_start_g = row_end_g - group_sizes_g

    block_ids_b = jnp.arange(num_blocks)
    group_b = jnp.searchsorted(block_end_g, block_ids_b, side="right")          # g = unused block
    group_b = jnp.minimum(group_b, g - 1)
    offset_br = (block_ids_b - block_start_g[group_b])[:, None] * block + jnp.arange(block)[None]
    valid_br = (offset_br >= 0) & (offset_br < group_sizes_g[group_b][:, None])
    src_br = jnp.where(valid_br, row_start_g[group_b][:, None] + offset_br, 0)
    x_brh = jnp.where(valid_br[..., None], x_mh[src_br], 0)

    if scan:
        def expert_block(x_rh, group):
            gate_hi, up_hi, down_ih = (jax.lax.dynamic_index_in_dim(w, group, keepdims=False)
                                       for w in (gate_ghi, up_ghi, down_gih))
            return swiglu(x_rh, gate_hi, up_hi, down_ih)

        def one_block(_, block_inputs):      # blocks past the last used one (all padding) are skipped
            x_rh, group, used = block_inputs
            return None, jax.lax.cond(used, expert_block, lambda x_rh, _: jnp.zeros_like(x_rh), x_rh, group)
        used_b = block_ids_b < block_end_g[-1]
        y_brh = jax.lax.scan(one_block, None, (x_brh, group_b, used_b))[1]
    else:
        h_bri = (jax.nn.silu(jnp.einsum("brh,bhi->bri", x_brh, gate_ghi[group_b]))
                 * jnp.einsum("brh,bhi->bri", x_brh, up_ghi[group_b]))
        y_brh = jnp.einsum("bri,bih->brh", h_bri, down_gih[group_b])
    y_rows = y_brh.reshape(num_blocks * block, -1)

    rows_m = jnp.arange(m)
    group_m = jnp.minimum(jnp.searchsorted(row_end_g, rows_m, side="right"), g - 1)
    pos_m = block_start_g[group_m] * block + rows_m - row_start_g[group_m]
    in_group_m = rows_m < row_end_g[-1]
    return jnp.where(in_group_m[:, None], y_rows[jnp.where(in_group_m, pos_m, 0)], 0)


GROUPED_EXPERT_MLPS = {"ragged": _ragged_expert_mlp, "blocked": _blocked_expert_mlp,
                       "scan": functools.partial(_blocked_expert_mlp, scan=True)}
AUTO_IMPL = {"tpu": "ragged", "gpu": "blocked", "cpu": "scan"}


def resolve_impl(impl: str) -> str:
    """`"auto"` -> the kernel for the platform compiled for (`dmtp_jax.platform`, `AUTO_IMPL`); checks the name."""
    if impl == "auto":
        return AUTO_IMPL.get(compile_platform(), "blocked")
    if impl not in GROUPED_EXPERT_MLPS:
        raise ValueError(f"unknown MoE impl '{impl}'; use auto, {', '.join(GROUPED_EXPERT_MLPS)}")
    return impl


def routed_expert_mlp(x_nh: jax.Array, weights_nk: jax.Array, experts_nk: jax.Array,
                      gate_ghi: jax.Array, up_ghi: jax.Array, down_gih: jax.Array,
                      first_expert=0, impl: str = "scan") -> jax.Array:
    """`sum_k weights_nk * expert_{experts_nk}(x_nh)` over the assignments whose expert is one of the
    G local experts `first_expert .. first_expert+G-1` (weights `[G, ...]`); others contribute 0.
    Returns fp32 `[N, H]` (the caller casts, after any cross-shard sum)."""
    n, top_k = experts_nk.shape
    g = gate_ghi.shape[0]
    local_m = experts_nk.reshape(-1) - first_expert
    group_m = jnp.where((local_m >= 0) & (local_m < g), local_m, g)            # g = not local
    order_m = jnp.argsort(group_m, stable=True)
    group_sizes_g = jnp.bincount(group_m, length=g + 1)[:g].astype(jnp.int32)
    y_sorted_mh = GROUPED_EXPERT_MLPS[impl](x_nh[order_m // top_k], group_sizes_g,
                                            gate_ghi, up_ghi, down_gih)
    inverse_m = jnp.zeros_like(order_m).at[order_m].set(jnp.arange(order_m.shape[0], dtype=order_m.dtype))
    y_nkh = y_sorted_mh[inverse_m].reshape(n, top_k, -1)
    weighted_nkh = jnp.where((group_m < g).reshape(n, top_k, 1), y_nkh * weights_nk[..., None], 0)
    return jnp.sum(weighted_nkh.astype(jnp.float32), axis=1)


# -------------------------------------------------------------------------------- expert parallelism

def weights_mesh(w: jax.Array):
    """The mesh `w` is placed on (abstract inside jit), else the context mesh; None if neither."""
    mesh = getattr(getattr(jax.typeof(w), "sharding", None), "mesh", None)
    if mesh is None or mesh.empty:
        mesh = jax.sharding.get_abstract_mesh()
    return None if mesh is None or mesh.empty or mesh.size <= 1 else mesh


def _axes(entry) -> tuple[str, ...]:
    return () if entry is None else ((entry,) if isinstance(entry, str) else tuple(entry))


def _expert_parallel_mlp(mesh, x_nh, weights_nk, experts_nk, gate_ehi, up_ehi, down_eih, impl):
    """`routed_expert_mlp` under `jax.shard_map` over `mesh`: experts over the "experts" mesh axes,
    the expert intermediate dim over the "mlp" ones, tokens over the "batch" ones; psum at the end."""
    (n, h), (e, _, i) = x_nh.shape, gate_ehi.shape
    tok_spec = spec_for(("batch",), (n,), mesh, DEFAULT_RULES)        # [N, ...] over the batch axes
    w_spec = spec_for(("experts", None, "mlp"), (e, h, i), mesh, DEFAULT_RULES)
    w_spec = tuple(w_spec) + (None,) * (3 - len(w_spec))
    expert_axes, mlp_axes = _axes(w_spec[0]), _axes(w_spec[2])
    local_experts = e // math.prod(mesh.shape[a] for a in expert_axes)
    gate_spec = P(w_spec[0], None, w_spec[2])
    down_spec = P(w_spec[0], w_spec[2], None)

    def shard(x_nh, weights_nk, experts_nk, gate_ghi, up_ghi, down_gih):
        summed = expert_axes + mlp_axes
        if summed:   # tokens are replicated over these axes: cast them to varying explicitly, so that
            # their cotangents get psum-ed (jax 0.10's implicit cast gave a wrong d/dx here)
            x_nh, weights_nk = (jax.lax.pcast(a, summed, to="varying") for a in (x_nh, weights_nk))
        first = jax.lax.axis_index(expert_axes) * local_experts if expert_axes else 0
        y_nh = routed_expert_mlp(x_nh, weights_nk, experts_nk, gate_ghi, up_ghi, down_gih, first, impl)
        return jax.lax.psum(y_nh, summed) if summed else y_nh

    return jax.shard_map(shard, mesh=mesh, in_specs=(tok_spec, tok_spec, tok_spec, gate_spec, gate_spec,
                                                     down_spec), out_specs=tok_spec)(
        x_nh, weights_nk, experts_nk, gate_ehi, up_ehi, down_eih)


def moe_mlp(x_nh: jax.Array, router_he: jax.Array, gate_ehi: jax.Array, up_ehi: jax.Array,
            down_eih: jax.Array, top_k: int, norm_topk_prob: bool, *, impl: str = "auto") -> jax.Array:
    """Sparse MoE MLP `[N, H] -> [N, H]` computing only the routed (token, expert) pairs; equal to
    `moe_mlp_dense`. Expert-parallel over the weights' mesh when there is one (module docstring)."""
    impl = resolve_impl(impl)
    weights_nk, experts_nk = moe_top_k(x_nh, router_he, top_k, norm_topk_prob)
    mesh = weights_mesh(gate_ehi)
    if mesh is None:
        y_nh = routed_expert_mlp(x_nh, weights_nk, experts_nk, gate_ehi, up_ehi, down_eih, 0, impl)
    else:
        y_nh = _expert_parallel_mlp(mesh, x_nh, weights_nk, experts_nk, gate_ehi, up_ehi, down_eih, impl)
    return y_nh.astype(x_nh.dtype)
