"""Sparse MoE (`dmtp_jax.layers.moe.moe_mlp`) equals the dense reference, in value and gradient, on one
device and with the experts sharded over 8 fake CPU devices; the token-chunked calls of the ragged /
blocked kernels equal one call; the scan kernel's temporaries scale with the routed rows, not the experts.

The 8-device check needs `--xla_force_host_platform_device_count=8` before jax is imported, so it runs
this file as a script in a subprocess (`python tests/test_moe.py --sharded`), which prints JSON.
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
SHARDED_MESHES = ["expert=8", "expert=4,data=2", "expert=2,fsdp=2,tensor=2"]
SHARDED_CASE = dict(n=24, h=16, e=16, i=8, k=4)
GRAD_ARGNUMS = (0, 1, 2, 3, 4)     # x, router, gate, up, down

if __name__ == "__main__" and "--sharded" in sys.argv:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()
    sys.path.insert(0, os.path.dirname(HERE))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from dmtp_jax.layers import moe as moe_layer  # noqa: E402
from dmtp_jax.layers.moe import block_rows_for, moe_mlp, moe_mlp_dense  # noqa: E402

WEIGHT_AXES = [("batch", None), ("embed", None), ("experts", "embed", "mlp"),
               ("experts", "embed", "mlp"), ("experts", "mlp", "embed")]


def random_moe(n: int, h: int, e: int, i: int, seed: int = 0, hot_experts: int | None = None):
    """`(x_nh, router_he, gate_ehi, up_ehi, down_eih)`; `hot_experts` biases the router towards the
    first few experts so that most experts receive no token."""
    rng = np.random.default_rng(seed)                       # numpy: no per-shape compiles
    x_nh = rng.standard_normal((n, h), np.float32)
    router_he = rng.standard_normal((h, e), np.float32) * 0.3
    if hot_experts is not None:
        x_nh[:, 0] = 1.0 + np.abs(x_nh[:, 0])
        router_he[0, :hot_experts] += 10.0
    gate_ehi, up_ehi = (rng.standard_normal((e, h, i), np.float32) * 0.3 for _ in range(2))
    down_eih = rng.standard_normal((e, i, h), np.float32) * 0.3
    return x_nh, router_he, gate_ehi, up_ehi, down_eih


def loss_fn(moe, top_k: int, norm: bool):
    return lambda *args: jnp.sum(jnp.sin(moe(*args, top_k, norm)))


# ------------------------------------------------------------------------------------------ one device

CASES = [  # (n, e, k, norm, hot_experts, impls)
    (1, 8, 2, True, None, ("scan", "blocked", "dense", "sliced")),     # decode, one token
    (7, 8, 3, False, None, ("scan", "blocked", "dense")),    # N*k = 21 not divisible by E
    (2, 256, 8, True, None, ("scan", "dense", "sliced")),    # E >> N*k: most experts get no row
    (50, 16, 4, True, 2, ("scan", "blocked", "ragged", "dense")),  # all tokens on the same 2 (+2) experts
]


def test_sparse_equals_dense_fp32():
    for n, e, k, norm, hot, impls in CASES:
        args = random_moe(n, 16, e, 8, seed=n + e, hot_experts=hot)
        ref_nh = np.asarray(jax.jit(moe_mlp_dense, static_argnums=(5, 6))(*args, k, norm))
        for impl in impls:
            y_nh = np.asarray(jax.jit(lambda *a: moe_mlp(*a, k, norm, impl=impl))(*args))
            assert y_nh.shape == (n, 16) and y_nh.dtype == np.float32
            np.testing.assert_allclose(y_nh, ref_nh, atol=2e-6, rtol=1e-5, err_msg=f"{impl} {n=} {e=} {k=}")


def test_sparse_bf16_close_to_dense():
    args = [a.astype(jnp.bfloat16) for a in random_moe(16, 32, 16, 16, seed=3)]
    y_nh = jax.jit(lambda *a: moe_mlp(*a, 4, True))(*args)
    assert y_nh.dtype == jnp.bfloat16
    ref_nh = jax.jit(moe_mlp_dense, static_argnums=(5, 6))(*[a.astype(jnp.float32) for a in args], 4, True)
    np.testing.assert_allclose(np.asarray(y_nh, np.float32), np.asarray(ref_nh), atol=0.05, rtol=0.05)


def test_gradients_equal_dense():
    for n, e, k, norm, hot, impls in [(7, 8, 3, True, None, ("scan", "blocked", "ragged", "dense")),
                                      (20, 32, 4, False, 3, ("scan",))]:
        args = random_moe(n, 16, e, 8, seed=e, hot_experts=hot)
        ref = jax.jit(jax.grad(loss_fn(moe_mlp_dense, k, norm), argnums=GRAD_ARGNUMS))(*args)
        for impl in impls:
            sparse = lambda *a, impl=impl: moe_mlp(*a, impl=impl)   # noqa: E731
            got = jax.jit(jax.grad(loss_fn(sparse, k, norm), argnums=GRAD_ARGNUMS))(*args)
            for name, g, r in zip(["x", "router", "gate", "up", "down"], got, ref):
                scale = max(1.0, float(np.max(np.abs(r))))      # fp32 sums in another order
                np.testing.assert_allclose(np.asarray(g), np.asarray(r), atol=2e-6 * scale, rtol=1e-5,
                                           err_msg=f"d/d{name} {impl} {n=} {e=} {k=}")


def test_token_chunks_equal_one_call(monkeypatch):
    """ragged / blocked run one call per MAX_ROUTED_ROWS // k tokens, dense per MAX_ROUTED_ROWS // E
    (the last chunk padded); same values and gradients as the dense reference."""
    monkeypatch.setattr(moe_layer, "MAX_ROUTED_ROWS", 24)    # k=4: 6 tokens per chunk, 13 = 6+6+1; dense: 1
    n, e, k = 13, 16, 4
    args = random_moe(n, 16, e, 8, seed=11)
    ref_nh = np.asarray(jax.jit(moe_mlp_dense, static_argnums=(5, 6))(*args, k, True))
    ref_grads = jax.jit(jax.grad(loss_fn(moe_mlp_dense, k, True), argnums=GRAD_ARGNUMS))(*args)
    for impl in ("ragged", "blocked", "dense"):
        moe = jax.jit(lambda *a, impl=impl: moe_mlp(*a, k, True, impl=impl))
        assert " while(" in moe.lower(*args).as_text(dialect="hlo"), impl     # really chunked
        np.testing.assert_allclose(np.asarray(moe(*args)), ref_nh, atol=2e-6, rtol=1e-5, err_msg=impl)
        sparse = lambda *a, impl=impl: moe_mlp(*a, impl=impl)   # noqa: E731
        got = jax.jit(jax.grad(loss_fn(sparse, k, True), argnums=GRAD_ARGNUMS))(*args)
        for name, g, r in zip(["x", "router", "gate", "up", "down"], got, ref_grads):
            scale = max(1.0, float(np.max(np.abs(r))))
            np.testing.assert_allclose(np.asarray(g), np.asarray(r), atol=2e-6 * scale, rtol=1e-5,
                                       err_msg=f"d/d{name} {impl} chunked")


def test_scan_temporaries_scale_with_routed_rows():
    """The compiled scan kernel holds no `N*k x H` sorted copy and no per-block weight copies: its
    temporaries stay under the routed rows' `N*k*(H+I)` plus the router's `[N, E]` probabilities,
    at 64 and 256 experts, far below one `[E, H, I]` weight."""
    n, h, i, k = 256, 64, 32, 8
    for e in (64, 256):
        shapes = [(n, h), (h, e), (e, h, i), (e, h, i), (e, i, h)]
        moe = jax.jit(lambda *a: moe_mlp(*a, k, True, impl="scan"))
        compiled = moe.lower(*(jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes)).compile()
        temp = compiled.memory_analysis().temp_size_in_bytes
        routed_bound = 4 * (n * k * (h + i) + 2 * n * e)
        assert temp <= routed_bound, (e, temp, routed_bound)
        assert temp < 4 * e * h * i / 2, (e, temp)


def test_auto_impl_follows_compile_platform():
    """auto: scan on CPU; dense up to 256 tokens per shard on GPU (160 on TPU), scan (ragged) beyond."""
    from dmtp_jax.platform import compiling_for
    for platform, impl, dense_max in [("tpu", "ragged", 160), ("gpu", "scan", 256), ("cpu", "scan", 0)]:
        with compiling_for(platform):
            assert moe_layer.resolve_impl("auto") == impl == moe_layer.AUTO_IMPL[platform]
            assert moe_layer.resolve_impl("auto", max(dense_max, 256) + 1) == impl
            assert moe_layer.resolve_impl("auto", 160) == ("dense" if dense_max else impl)
            assert moe_layer.resolve_impl("auto", 256) == ("dense" if dense_max >= 256 else impl)
            assert moe_layer.resolve_impl("ragged", 1) == "ragged"
            # whole (unstacked) weights: single experts sliced while pairs < local experts and <= 16
            assert moe_layer.resolve_impl("auto", 2, top_k=8, local_experts=64, stacked=False) == "sliced"
            assert moe_layer.resolve_impl("auto", 2, top_k=8, local_experts=64) == ("dense" if dense_max else impl)
            assert moe_layer.resolve_impl("auto", 1, top_k=8, local_experts=8, stacked=False) != "sliced"
            assert moe_layer.resolve_impl("auto", 3, top_k=8, local_experts=256, stacked=False) != "sliced"
    # the GPU choice on a real (CPU) trace: a dense einsum for decode-sized calls, the scan loop beyond
    args = random_moe(8, 16, 8, 8)
    with compiling_for("gpu"):
        decode = jax.jit(lambda *a: moe_mlp(*a, 2, True)).lower(*args).as_text(dialect="hlo")
    assert " while(" not in decode and " sort(" not in decode


def test_block_rows_keep_padding_bounded():
    assert block_rows_for(8, 256) == 1          # decode: one row per block, no padding
    assert block_rows_for(2048, 8) == 128       # capped
    assert block_rows_for(2048, 256) == 8


def test_unknown_impl_raises():
    import pytest
    with pytest.raises(ValueError, match="unknown MoE impl"):
        moe_mlp(*(np.zeros(s, np.float32) for s in [(2, 8), (8, 4), (4, 8, 4), (4, 8, 4), (4, 4, 8)]),
                2, True, impl="megablox")


def test_mesh_axes_keep_old_specs():
    from dmtp_jax.sharding import DEFAULT_RULES, MESH_AXES, parse_mesh_spec
    assert MESH_AXES == ("data", "fsdp", "expert", "tensor")
    assert parse_mesh_spec("tensor=4,data=2") == {"data": 2, "fsdp": 1, "expert": 1, "tensor": 4}
    assert parse_mesh_spec("fsdp=8")["expert"] == 1
    assert DEFAULT_RULES.lookup("experts") == ("expert",)


# ------------------------------------------------------------------------------------- 8 fake devices

def sharded_main() -> None:
    """Prints `{mesh: {"out": max |diff|, "grads": [max |diff|], "gate_spec": str, "collectives": [..]}}`
    against the unsharded result, for each of SHARDED_MESHES."""
    from dmtp_jax.sharding import DEFAULT_RULES, make_mesh, named_sharding

    c = SHARDED_CASE
    args = random_moe(c["n"], c["h"], c["e"], c["i"], seed=5)
    forward = jax.jit(lambda *a: moe_mlp(*a, c["k"], True, rules=DEFAULT_RULES))
    grads = jax.jit(jax.grad(loss_fn(functools.partial(moe_mlp, rules=DEFAULT_RULES), c["k"], True), argnums=GRAD_ARGNUMS))
    ref_out, ref_grads = forward(*args), grads(*args)
    report = {}
    for spec in SHARDED_MESHES:
        mesh = make_mesh(spec)
        placed = [jax.device_put(a, named_sharding(ax, a.shape, mesh)) for a, ax in zip(args, WEIGHT_AXES)]
        compiled = forward.lower(*placed).compile()
        report[spec] = {
            "out": float(jnp.max(jnp.abs(compiled(*placed) - ref_out))),
            "grads": [float(jnp.max(jnp.abs(g - r))) for g, r in zip(grads(*placed), ref_grads)],
            "gate_spec": str(placed[2].sharding.spec),
            "gathered_shapes": [[int(d) for d in m.group(1).split(",") if d] for m in re.finditer(
                r"= \w+\[([\d,]*)\]\S* all-gather\(", compiled.as_text())],
            "reduce_scatters": compiled.as_text().count(" reduce-scatter("),
        }
        dense = jax.jit(lambda *a: moe_mlp(*a, c["k"], True, impl="dense", rules=DEFAULT_RULES))     # the GPU decode kernel
        report[spec]["dense_out"] = float(jnp.max(jnp.abs(dense(*placed) - ref_out)))
        # the MTP's kernel: 3 tokens x top-4, each pair's expert sliced in place on whichever shard
        sliced = jax.jit(lambda *a: moe_mlp(*a, c["k"], True, impl="sliced", rules=DEFAULT_RULES))
        few = [jax.device_put(args[0][:3], named_sharding(("batch", None), (3, c["h"]), mesh))] + placed[1:]
        report[spec]["sliced_out"] = float(jnp.max(jnp.abs(sliced(*few) - ref_out[:3])))
    # ragged in token chunks inside each shard: 12 local tokens, 5 per chunk (last one padded)
    moe_layer.MAX_ROUTED_ROWS = 5 * c["k"]
    spec = "expert=4,data=2"
    mesh = make_mesh(spec)
    placed = [jax.device_put(a, named_sharding(ax, a.shape, mesh)) for a, ax in zip(args, WEIGHT_AXES)]
    chunked = jax.jit(lambda *a: moe_mlp(*a, c["k"], True, impl="ragged", rules=DEFAULT_RULES))
    report[spec]["ragged_chunked_out"] = float(jnp.max(jnp.abs(chunked(*placed) - ref_out)))
    print(json.dumps(report))


@pytest.mark.heavy
def test_expert_sharded_8_devices_equal_one_device():
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}     # the run's XLA_FLAGS (conftest's LLVM -O0) and 8 devices
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--sharded"], capture_output=True,
                          text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(report) == set(SHARDED_MESHES)
    for spec, r in report.items():
        assert "expert" in r["gate_spec"], (spec, r["gate_spec"])
        assert r["out"] <= 1e-5, (spec, r)
        assert max(r["grads"]) <= 1e-5, (spec, r)
        assert r["dense_out"] <= 1e-5, (spec, r)
        assert r["sliced_out"] <= 1e-5, (spec, r)
    assert report["expert=4,data=2"]["ragged_chunked_out"] <= 1e-5, report["expert=4,data=2"]
    # experts stay where they are: no [E, ...] expert weight is ever gathered whole (fsdp=2 gathers
    # the embed dim of the local experts); at expert=8 only the tokens ([N, ...], split over `expert`
    # like the batch) are gathered, and the outputs reduce-scattered back
    for spec, r in report.items():
        assert not any(len(s) == 3 and s[0] == SHARDED_CASE["e"] for s in r["gathered_shapes"]), (spec, r)
    assert report["expert=8"]["gathered_shapes"], report["expert=8"]
    assert all(s[0] == SHARDED_CASE["n"] and len(s) == 2 for s in report["expert=8"]["gathered_shapes"])
    assert report["expert=8"]["reduce_scatters"] >= 1, report["expert=8"]


if __name__ == "__main__" and "--sharded" in sys.argv:
    sharded_main()
