"""Row moves on a running state, for any state pytree (no per-architecture code): insert, put,
move, resize and extract rows along each leaf's batch axis (where a 1-row and a 2-row state differ,
`batch_axes`). A row that moves keeps its whole state. `RowMoves` jits them for one state layout.

Example:
    >>> axes = {"k": 1, "n": 0}
    >>> big = {"k": jnp.zeros((2, 4, 3)), "n": jnp.zeros(4)}
    >>> out = put_rows(axes, big, {"k": jnp.ones((2, 2, 3)), "n": jnp.array([7.0, 8.0])}, jnp.array([3, 9]))
    >>> out["n"].tolist()
    [0.0, 0.0, 0.0, 7.0]
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from dmtp_jax.counted_jit import counted_jit


def batch_axis(small_shape: tuple, big_shape: tuple) -> int:
    """The axis where a 1-row leaf and a B-row leaf differ (0 when they are equal: B == 1).

    Example:
        >>> batch_axis((4, 1, 128, 2, 8), (4, 8, 128, 2, 8))
        1
    """
    diff = [i for i, (a, b) in enumerate(zip(small_shape, big_shape)) if a != b]
    if len(small_shape) != len(big_shape) or len(diff) > 1 or (diff and small_shape[diff[0]] != 1):
        raise ValueError(f"a 1-row leaf {small_shape} does not fit {big_shape}")
    return diff[0] if diff else 0


def batch_axes(one_row, two_rows):
    """Each leaf's batch axis, as a pytree of ints, from a 1-row and a 2-row state (or their shapes)."""
    return jax.tree.map(lambda a, b: batch_axis(a.shape, b.shape), one_row, two_rows)


def insert_row(state, row_state, row):
    """`state` with row `row` replaced by the 1-row `row_state` (each leaf's axis by `batch_axis`)."""
    def put(big, small):
        axis = batch_axis(small.shape, big.shape)
        if small.shape == big.shape:
            return small.astype(big.dtype)
        return jax.lax.dynamic_update_slice_in_dim(big, small.astype(big.dtype), row, axis)
    return jax.tree.map(put, state, row_state)


def put_rows(axes, big, small, dst_g):
    """`big` with its rows `dst_g[i]` replaced by `small`'s row `i`; an index past `big`'s rows
    drops that row (a padding row of a prefill bucket). Where `small` has None for a part of `big`
    (a lean prefill's state leaves out the drafting caches), those rows of the part are zeroed: as a
    fresh state's would be.

    Example:
        >>> axes, big = {"k": 0, "n": 0}, {"k": jnp.ones(3), "n": jnp.ones(3)}
        >>> out = put_rows(axes, big, {"k": jnp.array([5.0]), "n": None}, jnp.array([1]))
        >>> out["k"].tolist(), out["n"].tolist()
        ([1.0, 5.0, 1.0], [1.0, 0.0, 1.0])
    """
    def at(axis, b):        # indexed at the batch axis in place: no transpose of `big`
        return b.at[(slice(None),) * axis + (dst_g,)]

    def put(s, b, axis):
        if s is None:
            return jax.tree.map(lambda x, a: at(a, x).set(0, mode="drop"), b, axis)
        return at(axis, b).set(s.astype(b.dtype), mode="drop")
    return jax.tree.map(put, small, big, axes, is_leaf=lambda x: x is None)


def move_row(axes, state, src, dst):
    """`state` with row `dst` overwritten by row `src`.

    Example:
        >>> move_row({"n": 0}, {"n": jnp.array([1.0, 2.0, 3.0])}, 2, 0)["n"].tolist()
        [3.0, 2.0, 3.0]
    """
    def move(axis, x):
        row = jax.lax.dynamic_slice_in_dim(x, src, 1, axis)
        return jax.lax.dynamic_update_slice_in_dim(x, row, dst, axis)
    return jax.tree.map(move, axes, state)


def resize_rows(axes, state, rows: int):
    """The first `rows` rows of every leaf, zero rows appended when `rows` is larger (static).

    Example:
        >>> resize_rows({"n": 0}, {"n": jnp.array([1.0, 2.0])}, 3)["n"].tolist()
        [1.0, 2.0, 0.0]
    """
    def resize(axis, x):
        have = x.shape[axis]
        if rows <= have:
            return jax.lax.slice_in_dim(x, 0, rows, axis=axis)
        pad = [(0, 0)] * x.ndim
        pad[axis] = (0, rows - have)
        return jnp.pad(x, pad)
    return jax.tree.map(resize, axes, state)


def extract_row(axes, state, row):
    """Row `row` of `state` as a 1-row state (a copy: `state` may be donated afterwards)."""
    return jax.tree.map(lambda axis, x: jax.lax.dynamic_slice_in_dim(x, row, 1, axis), axes, state)


class RowMoves:
    """The row moves jitted for states laid out like `one` (a 1-row state) and `two` (2 rows), every
    output at `one`'s shardings: `put` and `move` donate the big state, `resize` takes the row count
    static, `extract` copies one row. Compiles are counted (`compile_counts`)."""

    def __init__(self, one, two):
        self.axes = batch_axes(one, two)
        shardings = jax.tree.map(lambda x: x.sharding, one)
        self.put = counted_jit(functools.partial(put_rows, self.axes), donate_argnums=0, out_shardings=shardings)
        self.move = counted_jit(functools.partial(move_row, self.axes), donate_argnums=0, out_shardings=shardings)
        self.resize = counted_jit(functools.partial(resize_rows, self.axes), static_argnums=1,
                                  out_shardings=shardings)
        self.extract = counted_jit(functools.partial(extract_row, self.axes), out_shardings=shardings)

    def compile_counts(self) -> dict[str, int]:
        return {"put_rows": self.put.compiles, "move_row": self.move.compiles, "resize_rows": self.resize.compiles}


def same_shardings(a, b) -> bool:
    """Whether two states (any row counts) have the same parts, laid out alike on the devices, so a
    round compiled for one runs the other."""
    return jax.tree.structure(a) == jax.tree.structure(b) and all(
        x.sharding == y.sharding for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def compaction_moves(finished: list[bool]) -> tuple[list[tuple[int, int]], list[int]]:
    """`(moves, order)` that drop the finished rows of a running list: each `(src, dst)` moves a live
    row from past the live count into a finished row's place; `order[i]` is the old index of new row `i`.

    Example:
        >>> compaction_moves([False, True, False, True, False])
        ([(4, 1)], [0, 4, 2])
    """
    live = [i for i, done in enumerate(finished) if not done]
    n = len(live)
    moves = list(zip([i for i in range(n) if finished[i]], [i for i in live if i >= n]))
    order = list(range(len(finished)))
    for hole, src in moves:
        order[hole] = src
    return [(src, hole) for hole, src in moves], order[:n]
