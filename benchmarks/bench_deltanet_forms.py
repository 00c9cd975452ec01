"""Gated DeltaNet forward: the jitted chunked form against the token scan (`layers/gated_deltanet.py`).

    PYTHONPATH=. python benchmarks/bench_deltanet_forms.py [--tokens 512] [--repeats 5]

Times `gated_delta_recurrent` and `gated_delta_chunked` on random inputs (B=1, 4 key / value heads
of 32), the mean of `--repeats` calls after a compile, and checks that both give the same output.
Numbers compare the two forms within one run on one machine only.
"""

from __future__ import annotations

import argparse
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    from dmtp_jax.layers.gated_deltanet import gated_delta_chunked, gated_delta_recurrent, prepare_qk

    r, f, t = np.random.default_rng(11), np.float32, args.tokens
    q = prepare_qk(jnp.asarray(r.normal(size=(1, t, 4, 32)).astype(f)), 4, True)
    k = prepare_qk(jnp.asarray(r.normal(size=(1, t, 4, 32)).astype(f)), 4, False)
    rest = (r.normal(size=(1, t, 4, 32)), -r.uniform(size=(1, t, 4)), r.uniform(size=(1, t, 4)),
            r.normal(size=(1, 4, 32, 32)))
    inputs = (q, k) + tuple(jnp.asarray(a.astype(f)) for a in rest)
    outs = {}
    for name, fn in (("recurrent", gated_delta_recurrent), ("chunked", gated_delta_chunked)):
        jitted = jax.jit(fn)
        outs[name] = jax.block_until_ready(jitted(*inputs))
        t0 = time.perf_counter()
        for _ in range(args.repeats):
            jax.block_until_ready(jitted(*inputs))
        print(f"{name:9s} T={t} B=1 nv=4 dk=dv=32: {(time.perf_counter() - t0) / args.repeats * 1e3:.2f} ms")
    same = all(np.allclose(a, b, rtol=1e-4, atol=1e-4) for a, b in zip(jax.tree.leaves(outs["recurrent"]),
                                                                        jax.tree.leaves(outs["chunked"])))
    print(f"outputs agree (rtol/atol 1e-4): {same}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
