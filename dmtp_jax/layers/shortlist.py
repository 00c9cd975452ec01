"""The efficient drafting head's kernel: a low-rank shortlist of the vocabulary rescored exactly,
split over the mesh so that no vocabulary row crosses devices (the head itself:
`models/draft_head.py`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from dmtp_jax.errors import InputError
from dmtp_jax.sharding import MeshRules, mesh_axes, spec_for, weights_mesh


def shortlist_logits(x_nh: jax.Array, down_hr: jax.Array, up_rv: jax.Array, rows: jax.Array,
                     shortlist: int, ids: jax.Array | None = None, vocab: int | None = None,
                     rules: MeshRules | None = None) -> tuple[jax.Array, jax.Array]:
    """`(logits [N, V] fp32, rest_lse [N])`: `x_n . rows[v]` on the shortlist (the top of the low-rank
    scores `(x A) B`), -inf elsewhere; and the low-rank scores' logsumexp outside the shortlist.
    `rows`: `[V, H]` or `[V, *row_layout(H)]`. With `ids` (`[C]`, -1 for padding): only those ids of a
    `vocab`-entry vocabulary are scored. On a mesh each vocabulary shard shortlists its own
    `shortlist // S` ids from its own rows (docs/drafting-head.md); `rules`: the rows' mesh rules.

    Example:
        >>> rows = jnp.arange(12.0).reshape(4, 3)
        >>> logits, rest = shortlist_logits(jnp.ones((1, 3)), jnp.eye(3), rows.T, rows, 2)
        >>> logits.tolist(), round(float(rest[0]), 3)
        ([[-inf, -inf, 21.0, 30.0]], 12.0)
    """
    def local(x, down, up, rows, ids, k, embed_axes=(), vocab_axes=(), shards=1):
        z = jnp.dot(x, down, preferred_element_type=jnp.float32)
        z = (jax.lax.psum(z, embed_axes) if embed_axes else z).astype(x.dtype)
        approx = jnp.dot(z, up, preferred_element_type=jnp.float32)                   # [N, C_local]
        if ids is not None:
            approx = jnp.where(ids >= 0, approx, -jnp.inf)                           # padding
        _, idx = jax.lax.approx_max_k(approx, k)                   # [N, k]; exact top-k off TPU
        picked = jnp.take(rows, idx, axis=0)                        # [N, k, *row]
        exact = jnp.einsum("n...,nk...->nk", x.reshape(x.shape[0], *rows.shape[1:]), picked,
                           preferred_element_type=jnp.float32)
        exact = jax.lax.psum(exact, embed_axes) if embed_axes else exact
        n = jnp.arange(x.shape[0])[:, None]
        rest = jax.nn.logsumexp(approx.at[n, idx].set(-jnp.inf), axis=-1)
        if vocab_axes:                                              # logsumexp over the shards
            top = jax.lax.pmax(rest, vocab_axes)
            top = jnp.where(jnp.isfinite(top), top, 0.0)
            rest = top + jnp.log(jax.lax.psum(jnp.exp(rest - top), vocab_axes))
        if ids is None:
            logits = jnp.full(approx.shape, -jnp.inf, jnp.float32).at[n, idx].set(exact)
            return logits, rest
        gid = ids[idx]                                              # [N, k] vocabulary ids, -1: padding
        width, first = vocab, 0
        if vocab_axes:                  # every shard's rescored ids; keep those in this shard's part
            gid = jax.lax.all_gather(gid, vocab_axes, axis=1, tiled=True)
            exact = jax.lax.all_gather(exact, vocab_axes, axis=1, tiled=True)
            width = vocab // shards
            first = jax.lax.axis_index(vocab_axes) * width
        slot = gid - first
        slot = jnp.where((gid >= 0) & (slot >= 0) & (slot < width), slot, width)   # width: dropped
        logits = jnp.full((x.shape[0], width), -jnp.inf, jnp.float32).at[n, slot].set(exact, mode="drop")
        return logits, rest

    columns = rows.shape[0]
    vocab = columns if ids is None else int(vocab)
    mesh = weights_mesh(rows)
    if mesh is None:
        return local(x_nh, down_hr, up_rv, rows, ids, min(shortlist, columns))
    if rules is None:
        raise ValueError("shortlist_logits on a mesh needs the mesh rules its rows were placed with (rules=)")
    # the rows' own split (vocab, embed) and, for the N axis, the batch axes they leave free
    spec = tuple(spec_for(("vocab", "embed", "batch") if rows.ndim == 2 else ("vocab", "embed", None, "batch"),
                          (*rows.shape, x_nh.shape[0]), mesh, rules))
    spec += (None,) * (rows.ndim + 1 - len(spec))
    vocab_axes, embed_axes = mesh_axes(spec[0]), mesh_axes(spec[1])
    shards = int(np.prod([mesh.shape[a] for a in vocab_axes]))
    if vocab % shards:
        raise InputError(f"the efficient head's vocabulary subset splits over {shards} shards, the vocabulary "
                         f"of {vocab} does not")
    k = max(1, min(shortlist // shards, columns // shards))
    v_ax, e_ax, n_ax = spec[0], spec[1], spec[-1]       # spec_for gives None for an unsplit dim
    in_specs = (P(n_ax, e_ax), P(e_ax, None), P(None, v_ax), P(*spec[:-1]))
    if ids is None:
        fn = lambda x, d, u, r: local(x, d, u, r, None, k, embed_axes, vocab_axes, shards)  # noqa: E731
        args = (x_nh, down_hr, up_rv, rows)
    else:
        fn = lambda x, d, u, r, i: local(x, d, u, r, i, k, embed_axes, vocab_axes, shards)  # noqa: E731
        args, in_specs = (x_nh, down_hr, up_rv, rows, ids), in_specs + (P(v_ax),)
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=(P(n_ax, v_ax), P(n_ax)))(*args)
