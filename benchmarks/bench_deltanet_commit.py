"""How a verify round commits DeltaNet state: one chunk (ours) vs token replay vs per-slot snapshots,
one layer.

A verify block of `n` tokens runs the gated delta rule token by token (`gated_delta_recurrent`).
Afterwards each row must continue from the state after its accepted prefix. Three fixed-shape ways:

* one chunk (ours, `gated_delta_state_after`): the chunked form over the block with the rejected
  tokens' gates zeroed -- reads the state twice and writes it once;
* token replay (ours until stop 31): re-run the token scan over the first `keep_b` tokens -- reads and
  writes the state once per slot;
* snapshots: the verify scan also emits the state after every token (`n` states per row), and the
  commit gathers the one at the accepted index -- no second pass, `n` times the state memory.

Prints jitted wall time per call (median of repeats) for one DeltaNet layer at the sizes of
Qwen3.6-27B (nv 48) and 35B-A3B (nv 32), dk = dv = 128, the bytes each way holds, and the largest
difference of the one-chunk state from the token scan's (fp32 rounding; replay and snapshot agree
bit for bit).
Run: `python benchmarks/bench_deltanet_commit.py [--batch 1 4] [--slots 8]`.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from dmtp_jax.layers.gated_deltanet import (_delta_update, gated_delta_recurrent, gated_delta_state_after,
                                            prepare_qk)


def token_replay(k, v, g, beta, state, keep_b):
    """The token scan over the first `keep_b` tokens per row (later tokens leave the state as is)."""
    keep_bt = jnp.arange(k.shape[1])[None] < keep_b[:, None]

    def step(s, xs):
        k_t, v_t, g_t, beta_t, keep_t = xs
        return jnp.where(keep_t[:, None, None, None], _delta_update(s, k_t, v_t, g_t, beta_t), s), None
    xs = tuple(jnp.moveaxis(a, 1, 0) for a in (k, v, g, beta, keep_bt))
    return jax.lax.scan(step, state, xs)[0]


def snapshot_commit(q, k, v, g, beta, state, keep_b):
    """The alternative: states after every token, gathered at each row's kept count."""
    def step(s, xs):
        s = _delta_update(s, *xs)
        return s, s
    xs = tuple(jnp.moveaxis(a, 1, 0) for a in (k, v, g, beta))
    _, states = jax.lax.scan(step, state, xs)                  # [n, B, nv, dk, dv]
    states = jnp.concatenate([state[None], states], axis=0)   # keep 0 -> the old state
    return states[keep_b, jnp.arange(state.shape[0])]


def timed(fn, *args, repeats=20):
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--slots", type=int, default=8)
    args = parser.parse_args()
    n, dk = args.slots, 128
    print(f"one DeltaNet layer, verify block of {n}, dk = dv = {dk}, fp32 state; times in ms "
          f"(backend: {jax.default_backend()})")
    print(f"{'target':<18}{'B':>3}{'verify':>9}{'chunk':>8}{'replay':>9}{'snapshot':>10}{'state MiB':>11}"
          f"{'snap MiB':>10}{'chunk err':>11}")
    for name, nv in (("Qwen3.6-27B", 48), ("Qwen3.6-35B-A3B", 32)):
        for b in args.batch:
            keys = jax.random.split(jax.random.key(0), 6)
            q = prepare_qk(jax.random.normal(keys[0], (b, n, 16, dk)), nv, scale=True)
            k = prepare_qk(jax.random.normal(keys[1], (b, n, 16, dk)), nv, scale=False)
            v = jax.random.normal(keys[2], (b, n, nv, dk))
            g = -jax.nn.softplus(jax.random.normal(keys[3], (b, n, nv)))
            beta = jax.nn.sigmoid(jax.random.normal(keys[4], (b, n, nv)))
            state = jax.random.normal(keys[5], (b, nv, dk, dk)) * 0.1
            keep = jnp.asarray(np.random.default_rng(0).integers(0, n + 1, b), jnp.int32)
            verify = jax.jit(gated_delta_recurrent)
            chunk = jax.jit(gated_delta_state_after)
            replay = jax.jit(token_replay)
            snap = jax.jit(snapshot_commit)
            a = replay(k, v, g, beta, state, keep)
            c = snap(q, k, v, g, beta, state, keep)
            assert float(jnp.abs(a - c).max()) == 0.0, "replay and snapshot disagree"
            chunk_err = float(jnp.abs(chunk(k, v, g, beta, state, keep) - a).max())
            state_mib = b * nv * dk * dk * 4 / 2 ** 20
            print(f"{name:<18}{b:>3}{1e3 * timed(verify, q, k, v, g, beta, state):>9.2f}"
                  f"{1e3 * timed(chunk, k, v, g, beta, state, keep):>8.2f}"
                  f"{1e3 * timed(replay, k, v, g, beta, state, keep):>9.2f}"
                  f"{1e3 * timed(snap, q, k, v, g, beta, state, keep):>10.2f}{state_mib:>11.1f}{n * state_mib:>10.1f}"
                  f"{chunk_err:>11.1e}")


if __name__ == "__main__":
    main()
