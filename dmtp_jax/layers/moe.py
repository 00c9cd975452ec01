"""The Qwen3-MoE / Qwen3.5-MoE sparse block, computed only for the routed experts.

Router (as transformers' Qwen3MoeTopKRouter): fp32 softmax over experts, top-k, optional
renormalisation, weights cast to the activation dtype; DeepSeek-V3 / GLM-4.7-Flash route by
`grouped_sigmoid_top_k` and pass its result as `routing`. Expert `e` computes
`down_e(silu(x @ gate_e) * (x @ up_e))`; a token's output is `sum_k weight_k * y_{e_k}`. Shapes are
fixed (N*k routed rows), so it jits and is differentiable. Kernels (`impl`), all equal to
`moe_mlp_dense`:

- `"ragged"`: rows sorted by expert, three `jax.lax.ragged_dot`s (a grouped GEMM on TPU).
- `"blocked"`: each expert's rows padded to blocks, one batched matmul over the blocks.
- `"scan"`: the same blocks in a `lax.scan`, weights sliced in place, unused blocks skipped.
- `"dense"`: every local expert on every token, unrouted pairs masked (decode-sized calls).
- `"sliced"`: each routed (token, expert) pair alone, its expert sliced in place (few pairs, whole
  weight arrays: the MTP's layer).
- `"auto"` (default): `"sliced"` where it applies, else `"dense"` up to `AUTO_DENSE_MAX_TOKENS`
  per shard, else `AUTO_IMPL` of the compile platform. The measurements behind it: `docs/moe.md`.

ragged, blocked and dense run one call per at most `MAX_ROUTED_ROWS` rows (a `lax.map` over token
chunks).

Expert parallelism: on a mesh of more than one device (the weights' own, else the context mesh)
the routed part runs under `jax.shard_map`: experts over the "experts" mesh axes and their
intermediate dim over the "mlp" ones of the `rules` the weights were placed with; tokens come in
over the "batch" axes, are gathered over the expert axes, and the partial outputs are summed
(`psum` over tensor) and reduce-scattered back (`psum_scatter` over expert). Not for use inside
another `shard_map`.

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

from dmtp_jax.layers.mlp import gated_mlp
from dmtp_jax.platform import compile_platform
from dmtp_jax.sharding import MeshRules, mesh_axes, spec_for, weights_mesh

MAX_BLOCK_ROWS = 128
MAX_ROUTED_ROWS = 32768      # ragged / blocked: at most this many (token, expert) rows per call


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


def grouped_sigmoid_top_k(x_nh: jax.Array, router_he: jax.Array, bias_e: jax.Array, top_k: int, n_group: int,
                          topk_group: int, norm_topk_prob: bool, scaling: float) -> tuple[jax.Array, jax.Array]:
    """DeepSeek-V3's router (transformers' `DeepseekV3TopkRouter`), `(weights_nk in x dtype, experts_nk
    int32)`: fp32 sigmoid scores; the choice uses `scores + bias_e`: the `topk_group` groups of
    `E / n_group` experts with the largest sum of their two best, then the top-k experts inside them;
    the weights are the plain scores of those, optionally renormalised, times `scaling`.

    Example:
        >>> w, e = grouped_sigmoid_top_k(jnp.array([[1.0, 0.5]]), jnp.eye(2, 4), jnp.zeros(4), 1, 2, 1, True, 2.5)
        >>> e.tolist(), w.tolist()
        ([[0]], [[2.5]])
    """
    e = router_he.shape[-1]
    scores_ne = jax.nn.sigmoid(x_nh.astype(jnp.float32) @ router_he.astype(jnp.float32))
    choice_ne = scores_ne + bias_e.astype(jnp.float32)
    group_ng = jnp.sum(jax.lax.top_k(choice_ne.reshape(-1, n_group, e // n_group), min(2, e // n_group))[0], -1)
    _, groups_nk = jax.lax.top_k(group_ng, topk_group)
    keep_ng = jnp.sum(jax.nn.one_hot(groups_nk, n_group, dtype=jnp.int32), axis=1) > 0
    keep_ne = jnp.repeat(keep_ng, e // n_group, axis=1)
    _, experts_nk = jax.lax.top_k(jnp.where(keep_ne, choice_ne, -jnp.inf), top_k)
    weights_nk = jnp.take_along_axis(scores_ne, experts_nk, axis=-1)
    if norm_topk_prob:
        weights_nk = weights_nk / (jnp.sum(weights_nk, axis=-1, keepdims=True) + 1e-20)
    return (weights_nk * scaling).astype(x_nh.dtype), experts_nk.astype(jnp.int32)


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
    """Rows per block of the blocked / scan kernels: the power of two <= rows per group, in [1, 128]; so the
    padding (< one block per non-empty group) stays below about `num_rows`."""
    per_group = max(1, num_rows // max(1, num_groups))
    return min(MAX_BLOCK_ROWS, 1 << (per_group.bit_length() - 1))


def _block_layout(m: int, group_sizes_g: jax.Array, g: int):
    """Blocks of B rows (`block_rows_for`), one group each, over `m` rows sorted by group:
    `(B, num_blocks, block_start_g, block_end_g, row_start_g, row_end_g, block_ids_b, group_b)`.
    Every non-empty block holds >= 1 row and only the last block of a group is partial, so
    `num_blocks = min(m, m // B + min(g, m))` always suffices; `group_b` of unused blocks is g - 1."""
    block = block_rows_for(m, g)
    num_blocks = min(m, m // block + min(g, m))
    blocks_g = (group_sizes_g + block - 1) // block
    block_end_g = jnp.cumsum(blocks_g)
    block_start_g = block_end_g - blocks_g
    row_end_g = jnp.cumsum(group_sizes_g)
    row_start_g = row_end_g - group_sizes_g
    block_ids_b = jnp.arange(num_blocks)
    group_b = jnp.minimum(jnp.searchsorted(block_end_g, block_ids_b, side="right"), g - 1)
    return block, num_blocks, block_start_g, block_end_g, row_start_g, row_end_g, block_ids_b, group_b


def _blocked_expert_mlp(x_mh, group_sizes_g, gate_ghi, up_ghi, down_gih):
    """Same contract as `_ragged_expert_mlp`, without ragged_dot: groups padded to blocks of B rows,
    one expert per block, and one batched matmul over the blocks with per-block gathered copies of
    the weights (`blocks x H x I`: GBs per layer at prefill sizes; see the module docstring)."""
    m, g = x_mh.shape[0], gate_ghi.shape[0]
    block, num_blocks, block_start_g, block_end_g, row_start_g, row_end_g, block_ids_b, group_b = \
        _block_layout(m, group_sizes_g, g)
    offset_br = (block_ids_b - block_start_g[group_b])[:, None] * block + jnp.arange(block)[None]
    valid_br = (offset_br >= 0) & (offset_br < group_sizes_g[group_b][:, None])
    src_br = jnp.where(valid_br, row_start_g[group_b][:, None] + offset_br, 0)
    x_brh = jnp.where(valid_br[..., None], x_mh[src_br], 0)
    h_bri = (jax.nn.silu(jnp.einsum("brh,bhi->bri", x_brh, gate_ghi[group_b]))
             * jnp.einsum("brh,bhi->bri", x_brh, up_ghi[group_b]))
    y_rows = jnp.einsum("bri,bih->brh", h_bri, down_gih[group_b]).reshape(num_blocks * block, -1)

    rows_m = jnp.arange(m)
    group_m = jnp.minimum(jnp.searchsorted(row_end_g, rows_m, side="right"), g - 1)
    pos_m = block_start_g[group_m] * block + rows_m - row_start_g[group_m]
    in_group_m = rows_m < row_end_g[-1]
    return jnp.where(in_group_m[:, None], y_rows[jnp.where(in_group_m, pos_m, 0)], 0)


def _dense_expert_mlp(x_nh, weights_nk, experts_nk, gate_ghi, up_ghi, down_gih, first_expert=0):
    """Every local expert on every token, unrouted pairs masked before the down projection: fp32
    `[N, H]`. One read of the local weights; `E/k` times the routed flops, so for few tokens (decode)."""
    g = gate_ghi.shape[0]
    onehot_nkg = jax.nn.one_hot(experts_nk - first_expert, g, dtype=weights_nk.dtype)  # not local: 0
    combine_ng = jnp.einsum("nk,nkg->ng", weights_nk, onehot_nkg)
    routed_ng = jnp.any(onehot_nkg > 0, axis=1)
    # batched over the experts (as the weights are laid out: no weight transposes)
    x_gnh = jnp.broadcast_to(x_nh, (g,) + x_nh.shape)
    h_gni = (jax.nn.silu(jnp.einsum("gnh,ghi->gni", x_gnh, gate_ghi))
             * jnp.einsum("gnh,ghi->gni", x_gnh, up_ghi))
    h_gni = jnp.where(routed_ng.T[..., None], h_gni * combine_ng.T[..., None], 0)   # no inf * 0
    return jnp.einsum("gni,gih->nh", h_gni, down_gih, preferred_element_type=jnp.float32)


def _sliced_expert_mlp(x_nh, weights_nk, experts_nk, gate_ghi, up_ghi, down_gih, first_expert=0):
    """Each routed (token, expert) pair on its own, its expert's matrices sliced in place (a pair whose
    expert is not local adds 0): reads N*k experts' weights, not all G. fp32 `[N, H]`. Unrolled over
    the pairs: for few pairs on weights that are whole arrays (an MTP step at small batch)."""
    g = gate_ghi.shape[0]
    local_nk = experts_nk - first_expert
    rows = []
    for n in range(x_nh.shape[0]):
        x_1h, y_1h = x_nh[n:n + 1], jnp.zeros((1, x_nh.shape[1]), jnp.float32)
        for k in range(experts_nk.shape[1]):
            e = local_nk[n, k]
            gate_hi, up_hi, down_ih = (jax.lax.dynamic_index_in_dim(w, jnp.clip(e, 0, g - 1), keepdims=False)
                                       for w in (gate_ghi, up_ghi, down_gih))
            h_1i = jax.nn.silu(x_1h @ gate_hi) * (x_1h @ up_hi)
            h_1i = jnp.where((e >= 0) & (e < g), h_1i * weights_nk[n, k], 0)
            y_1h = y_1h + jnp.dot(h_1i, down_ih, preferred_element_type=jnp.float32)
        rows.append(y_1h)
    return jnp.concatenate(rows, axis=0)


def _scan_expert_mlp(x_nh, token_m, weight_m, group_sizes_g, gate_ghi, up_ghi, down_gih):
    """`sum` over the sorted local assignments `m` (`group_sizes_g` per expert, the non-local rest last)
    of `weight_m * expert(x_nh[token_m])`, as fp32 `[N, H]`: a `lax.scan` over blocks of B rows of one
    expert gathers the block's tokens, slices its expert in place and scatter-adds into the
    accumulator; unused blocks are skipped (`lax.cond`). No `N*k x H` or `blocks x H x I` temporary."""
    n, h = x_nh.shape
    m, g = token_m.shape[0], gate_ghi.shape[0]
    block, num_blocks, block_start_g, block_end_g, row_start_g, row_end_g, block_ids_b, group_b = \
        _block_layout(m, group_sizes_g, g)
    first_row_b = row_start_g[group_b] + (block_ids_b - block_start_g[group_b]) * block
    rows_b = jnp.where(block_ids_b < block_end_g[-1],
                       jnp.clip(row_end_g[group_b] - first_row_b, 0, block), 0)
    first_row_b = jnp.minimum(first_row_b, m)          # unused blocks: any in-range start
    # padded by one block, so that a block starting near the end slices in range
    token_pad = jnp.concatenate([token_m, jnp.full((block,), n, token_m.dtype)])
    weight_pad = jnp.concatenate([weight_m, jnp.zeros((block,), weight_m.dtype)])
    rows_r = jnp.arange(block)

    # The backward pass keeps each block's matmul outputs (B rows) and re-slices the expert weights
    # and re-gathers the token rows; without the checkpoint the cond would hand every block's weight
    # slice to the scan as a residual (blocks x H x I, GBs at prefill sizes).
    @functools.partial(jax.checkpoint, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
    def block_rows(group, first_row, rows):
        valid_r = rows_r < rows
        # invalid rows get distinct out-of-range tokens n+r: dropped by the scatter, which then has
        # sorted unique indices (a token meets each expert at most once, in token order)
        token_r = jnp.where(valid_r, jax.lax.dynamic_slice_in_dim(token_pad, first_row, block), n + rows_r)
        weight_r = jax.lax.dynamic_slice_in_dim(weight_pad, first_row, block)

        def compute(token_r, weight_r):
            x_rh = x_nh.at[token_r].get(mode="fill", fill_value=0, indices_are_sorted=True,
                                        unique_indices=True)
            gate_hi, up_hi, down_ih = (jax.lax.dynamic_index_in_dim(w, group, keepdims=False)
                                       for w in (gate_ghi, up_ghi, down_gih))
            return (gated_mlp(x_rh, gate_hi, up_hi, down_ih) * weight_r[:, None]).astype(jnp.float32)

        def skip(token_r, weight_r):
            return jnp.zeros_like(weight_r, shape=(block, h), dtype=jnp.float32)

        return token_r, jax.lax.cond(rows > 0, compute, skip, token_r, weight_r)

    def one_block(acc_nh, block_inputs):
        token_r, y_rh = block_rows(*block_inputs)
        return acc_nh.at[token_r].add(y_rh, mode="drop", indices_are_sorted=True, unique_indices=True), None

    acc_nh = jnp.zeros_like(x_nh, dtype=jnp.float32)
    return jax.lax.scan(one_block, acc_nh, (group_b, first_row_b, rows_b))[0]


# ragged / blocked map sorted rows to sorted rows; scan and dense (called by routed_expert_mlp with
# other arguments) return the combined fp32 [N, H]
GROUPED_EXPERT_MLPS = {"ragged": _ragged_expert_mlp, "blocked": _blocked_expert_mlp, "scan": _scan_expert_mlp,
                       "dense": _dense_expert_mlp, "sliced": _sliced_expert_mlp}
AUTO_IMPL = {"tpu": "ragged", "gpu": "scan", "cpu": "scan"}
# platforms where calls of at most this many (per-shard) tokens use "dense" under "auto": about peak
# bf16 flops / HBM bandwidth, below which dense's extra flops cost less than reading the weights
# (the derivation: docs/moe.md)
AUTO_DENSE_MAX_TOKENS = {"gpu": 256, "tpu": 160}
CHUNKED_IMPLS = ("ragged", "blocked", "dense")
SLICED_MAX_PAIRS = 16        # "sliced" is unrolled over the (token, expert) pairs: at most this many


def resolve_impl(impl: str, num_tokens: int | None = None, *, top_k: int = 0, local_experts: int = 0,
                 stacked: bool = True) -> str:
    """`"auto"` -> the kernel for the platform compiled for (`dmtp_jax.platform`, `AUTO_IMPL`; `"dense"`
    for at most `AUTO_DENSE_MAX_TOKENS` tokens where set, when `num_tokens` is given); on any platform
    `"sliced"` for weights that are whole arrays (`stacked=False`: not a slice of the layer stack) when
    the call has fewer routed pairs than local experts (and at most `SLICED_MAX_PAIRS`). Checks the name.

    Example:
        >>> resolve_impl("auto", 1, top_k=8, local_experts=64, stacked=False)
        'sliced'
    """
    if impl == "auto":
        platform = compile_platform()
        pairs = (num_tokens or 0) * top_k
        if not stacked and num_tokens is not None and pairs <= SLICED_MAX_PAIRS and pairs < local_experts:
            return "sliced"
        if num_tokens is not None and num_tokens <= AUTO_DENSE_MAX_TOKENS.get(platform, 0):
            return "dense"
        return AUTO_IMPL.get(platform, "scan")
    if impl not in GROUPED_EXPERT_MLPS:
        raise ValueError(f"unknown MoE impl '{impl}'; use auto, {', '.join(GROUPED_EXPERT_MLPS)}")
    return impl


def _chunked(routed, chunk: int, x_nh, weights_nk, experts_nk):
    """`routed(x, weights, experts)` over consecutive chunks of `chunk` tokens (a `lax.map`); padding
    tokens get expert -1, which is never local, so they contribute nothing."""
    n = x_nh.shape[0]
    num_chunks = -(-n // chunk)
    pad = num_chunks * chunk - n
    x_nh, weights_nk = (jnp.pad(a, ((0, pad), (0, 0))) for a in (x_nh, weights_nk))
    experts_nk = jnp.pad(experts_nk, ((0, pad), (0, 0)), constant_values=-1)
    y_cth = jax.lax.map(lambda c: routed(*c), tuple(a.reshape(num_chunks, chunk, -1)
                                                    for a in (x_nh, weights_nk, experts_nk)))
    return y_cth.reshape(num_chunks * chunk, -1)[:n]


def routed_expert_mlp(x_nh: jax.Array, weights_nk: jax.Array, experts_nk: jax.Array,
                      gate_ghi: jax.Array, up_ghi: jax.Array, down_gih: jax.Array,
                      first_expert=0, impl: str = "auto", stacked: bool = True) -> jax.Array:
    """`sum_k weights_nk * expert_{experts_nk}(x_nh)` over the assignments whose expert is one of the
    G local experts `first_expert .. first_expert+G-1` (weights `[G, ...]`); others contribute 0.
    A token's k experts are distinct (as `moe_top_k` gives them). Returns fp32 `[N, H]` (the caller
    casts, after any cross-shard sum). `stacked=False`: the weights are whole arrays (`resolve_impl`)."""
    n, top_k = experts_nk.shape
    g = gate_ghi.shape[0]
    impl = resolve_impl(impl, n, top_k=top_k, local_experts=g, stacked=stacked)
    if impl == "sliced" and n * top_k > SLICED_MAX_PAIRS:
        raise ValueError(f"MoE impl 'sliced' is unrolled over at most {SLICED_MAX_PAIRS} (token, expert) pairs, "
                         f"got {n} tokens x top-{top_k}")
    chunk = max(1, MAX_ROUTED_ROWS // (g if impl == "dense" else top_k))
    if impl in CHUNKED_IMPLS and n > chunk:     # these hold [N*k or N*G, ...]: <= chunk tokens per call
        return _chunked(functools.partial(routed_expert_mlp, gate_ghi=gate_ghi, up_ghi=up_ghi,
                                          down_gih=down_gih, first_expert=first_expert, impl=impl),
                        chunk, x_nh, weights_nk, experts_nk)
    if impl in ("dense", "sliced"):
        return GROUPED_EXPERT_MLPS[impl](x_nh, weights_nk, experts_nk, gate_ghi, up_ghi, down_gih, first_expert)
    local_m = experts_nk.reshape(-1) - first_expert
    group_m = jnp.where((local_m >= 0) & (local_m < g), local_m, g)            # g = not local
    order_m = jnp.argsort(group_m, stable=True)
    group_sizes_g = jnp.bincount(group_m, length=g + 1)[:g].astype(jnp.int32)
    if impl == "scan":
        return _scan_expert_mlp(x_nh, (order_m // top_k).astype(jnp.int32), weights_nk.reshape(-1)[order_m],
                                group_sizes_g, gate_ghi, up_ghi, down_gih)
    y_sorted_mh = GROUPED_EXPERT_MLPS[impl](x_nh[order_m // top_k], group_sizes_g,
                                            gate_ghi, up_ghi, down_gih)
    inverse_m = jnp.zeros_like(order_m).at[order_m].set(jnp.arange(order_m.shape[0], dtype=order_m.dtype))
    y_nkh = y_sorted_mh[inverse_m].reshape(n, top_k, -1)
    weighted_nkh = jnp.where((group_m < g).reshape(n, top_k, 1), y_nkh * weights_nk[..., None], 0)
    return jnp.sum(weighted_nkh.astype(jnp.float32), axis=1)


# -------------------------------------------------------------------------------- expert parallelism

def _expert_parallel_mlp(mesh, rules: MeshRules, x_nh, weights_nk, experts_nk, gate_ehi, up_ehi, down_eih, impl,
                         stacked):
    """`routed_expert_mlp` under `jax.shard_map` over `mesh`: experts over the "experts" mesh axes,
    the expert intermediate dim over the "mlp" ones; tokens come in over the "batch" axes minus those
    (gathered over `expert`), and the partial outputs are reduce-scattered back over the batch axes
    (`psum_scatter` over `expert`, `psum` over `tensor`)."""
    (n, h), (e, _, i) = x_nh.shape, gate_ehi.shape
    w_spec = spec_for(("experts", None, "mlp"), (e, h, i), mesh, rules)
    w_spec = tuple(w_spec) + (None,) * (3 - len(w_spec))
    expert_axes, mlp_axes = mesh_axes(w_spec[0]), mesh_axes(w_spec[2])
    summed = expert_axes + mlp_axes
    local_experts = e // math.prod(mesh.shape[a] for a in expert_axes)
    gather_rules = MeshRules((("tokens", tuple(a for a in rules.lookup("batch") if a not in summed)),))
    in_spec = spec_for(("tokens",), (n,), mesh, gather_rules)           # [N, ...], whole over `summed`
    out_spec = spec_for(("batch",), (n,), mesh, rules)          # [N, ...] as the batch rule splits it
    in_axes, out_axes = mesh_axes(in_spec[0] if in_spec else None), mesh_axes(out_spec[0] if out_spec else None)
    if out_axes[:len(in_axes)] != in_axes or not set(out_axes[len(in_axes):]) <= set(summed):
        out_spec, out_axes = in_spec, in_axes          # not a reduce-scatter of the input's split: psum
    scattered = out_axes[len(in_axes):]
    gate_spec = P(w_spec[0], None, w_spec[2])
    down_spec = P(w_spec[0], w_spec[2], None)

    def shard(x_nh, weights_nk, experts_nk, gate_ghi, up_ghi, down_gih):
        if summed:   # tokens are replicated over these axes: cast them to varying explicitly, so that
            # their cotangents get psum-ed (jax 0.10's implicit cast gave a wrong d/dx here)
            x_nh, weights_nk = (jax.lax.pcast(a, summed, to="varying") for a in (x_nh, weights_nk))
        first = jax.lax.axis_index(expert_axes) * local_experts if expert_axes else 0
        y_nh = routed_expert_mlp(x_nh, weights_nk, experts_nk, gate_ghi, up_ghi, down_gih, first, impl, stacked)
        rest = tuple(a for a in summed if a not in scattered)
        if rest:
            y_nh = jax.lax.psum(y_nh, rest)
        if scattered:
            y_nh = jax.lax.psum_scatter(y_nh, scattered, scatter_dimension=0, tiled=True)
        return y_nh

    return jax.shard_map(shard, mesh=mesh, in_specs=(in_spec, in_spec, in_spec, gate_spec, gate_spec, down_spec),
                         out_specs=out_spec)(x_nh, weights_nk, experts_nk, gate_ehi, up_ehi, down_eih)


def moe_mlp(x_nh: jax.Array, router_he: jax.Array, gate_ehi: jax.Array, up_ehi: jax.Array,
            down_eih: jax.Array, top_k: int, norm_topk_prob: bool, *, impl: str = "auto",
            stacked: bool = True, rules: MeshRules | None = None,
            routing: tuple[jax.Array, jax.Array] | None = None) -> jax.Array:
    """Sparse MoE MLP `[N, H] -> [N, H]` computing the routed (token, expert) pairs (`impl`: module
    docstring); equal to `moe_mlp_dense`. Expert-parallel over the weights' mesh when there is one (module docstring).
    `stacked=False` says the expert weights are whole arrays, not a layer's slice of a scanned stack
    (the MTP's layer): then `auto` may slice single experts in place (`"sliced"`). `rules`: the
    mesh rules the weights were placed with, needed on a mesh of more than one device. `routing`: the
    `(weights_nk, experts_nk)` of another router (`grouped_sigmoid_top_k`) instead of `moe_top_k`'s."""
    resolve_impl(impl)          # checks the name; "auto" is resolved per shard, by its token count
    weights_nk, experts_nk = routing or moe_top_k(x_nh, router_he, top_k, norm_topk_prob)
    mesh = weights_mesh(gate_ehi)
    if mesh is None:
        y_nh = routed_expert_mlp(x_nh, weights_nk, experts_nk, gate_ehi, up_ehi, down_eih, 0, impl, stacked)
    else:
        if rules is None:
            raise ValueError("moe_mlp on a mesh needs the mesh rules its weights were placed with (rules=)")
        y_nh = _expert_parallel_mlp(mesh, rules, x_nh, weights_nk, experts_nk, gate_ehi, up_ehi, down_eih, impl, stacked)
    return y_nh.astype(x_nh.dtype)
