"""Gated DeltaNet pure functions: the chunked form equals the token scan (with an initial state,
masked tokens, padding to the chunk size, strong decays, bf16 inputs) and both equal transformers'
torch rules; the causal conv and its window, the partial-block state and the gated RMSNorm equal
their transformers counterparts; gradients through the chunked form are finite and match the scan.
Timing of the two forms: `benchmarks/bench_deltanet_forms.py`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from transformers.models.qwen3_5.modeling_qwen3_5 import (
    Qwen3_5RMSNormGated, causal_conv1d_fn, causal_conv1d_update, torch_chunk_gated_delta_rule,
    torch_recurrent_gated_delta_rule)

from dmtp_jax.layers.gated_deltanet import (
    RECURRENT_MAX_TOKENS, causal_conv_silu, conv_window_after, gated_delta_chunked, gated_delta_recurrent,
    gated_delta_rule, gated_delta_state_after, gated_rms_norm, prepare_qk)

B, NK, NV, DK, DV = 2, 2, 4, 8, 8
LENGTHS = (1, 5, 64, 70, 130)
TOL = dict(rtol=1e-5, atol=1e-5)


def make_inputs(t, seed, g_max=1.0, nk=NK, nv=NV, dk=DK, dv=DV, b=B):
    """Raw (un-normalised, un-repeated) q/k `[B, T, nk, dk]`, v, g in (-g_max, 0], beta, state."""
    r = np.random.default_rng(seed)
    f = np.float32
    return dict(q=r.normal(size=(b, t, nk, dk)).astype(f), k=r.normal(size=(b, t, nk, dk)).astype(f),
                v=r.normal(size=(b, t, nv, dv)).astype(f),
                g=(-g_max * r.uniform(size=(b, t, nv))).astype(f),
                beta=r.uniform(size=(b, t, nv)).astype(f),
                state=r.normal(size=(b, nv, dk, dv)).astype(f))


def ours(fn, x, nv=NV):
    q, k = prepare_qk(jnp.asarray(x["q"]), nv, True), prepare_qk(jnp.asarray(x["k"]), nv, False)
    return fn(q, k, jnp.asarray(x["v"]), jnp.asarray(x["g"]), jnp.asarray(x["beta"]), jnp.asarray(x["state"]))


def numpy_reference(q, k, v, g, beta, state):
    """The gated delta rule token by token in float64 numpy (q, k prepared): `(o, final state)`."""
    q, k, v, g, beta, state = (np.asarray(a, np.float64) for a in (q, k, v, g, beta, state))
    out = np.zeros(v.shape)
    for t in range(q.shape[1]):
        state = state * np.exp(g[:, t])[:, :, None, None]
        delta = (v[:, t] - np.einsum("bhkv,bhk->bhv", state, k[:, t])) * beta[:, t, :, None]
        state = state + k[:, t, :, :, None] * delta[:, :, None, :]
        out[:, t] = np.einsum("bhkv,bhk->bhv", state, q[:, t])
    return out, state


chunked_jit = jax.jit(gated_delta_chunked)      # module-level: one compile per shape for the file
recurrent_jit = jax.jit(gated_delta_recurrent)


@pytest.mark.parametrize("t", LENGTHS)
def test_chunked_equals_recurrent(t):
    """Typical, strong (exp(cumsum) underflows within a chunk) and near-zero decays."""
    for g_max in (1.0, 20.0, 0.01):
        x = make_inputs(t, seed=t, g_max=g_max)
        o1, s1 = ours(recurrent_jit, x)
        o2, s2 = ours(chunked_jit, x)
        assert o2.shape == o1.shape and o2.dtype == jnp.float32
        np.testing.assert_allclose(o2, o1, **TOL)
        np.testing.assert_allclose(s2, s1, **TOL)


@pytest.mark.parametrize("t", (5, 70, 130))
def test_masked_tokens_are_skipped(t):
    """g = beta = 0 tokens leave the state unchanged: the kept tokens' outputs and the final state equal
    those of the sequence without the masked tokens."""
    x = make_inputs(t, seed=100 + t, g_max=2.0)
    keep = np.random.default_rng(t).uniform(size=t) < 0.6   # the same positions in every row
    keep[0] = True
    masked = dict(x, g=np.where(keep[None, :, None], x["g"], 0.0).astype(np.float32),
                  beta=np.where(keep[None, :, None], x["beta"], 0.0).astype(np.float32))
    short = {n: (a[:, keep] if n != "state" else a) for n, a in x.items()}
    o_ref, s_ref = ours(numpy_reference, short)
    for fn in (recurrent_jit, chunked_jit):
        o, s = ours(fn, masked)
        np.testing.assert_allclose(o[:, keep], o_ref, **TOL)
        np.testing.assert_allclose(s, s_ref, **TOL)


def test_bf16_inputs():
    """bf16 q/k/v are upcast first: the same as feeding their fp32 values (and the scan agrees)."""
    x = make_inputs(70, seed=7)
    q, k = prepare_qk(jnp.asarray(x["q"]), NV, True), prepare_qk(jnp.asarray(x["k"]), NV, False)
    bf = [a.astype(jnp.bfloat16) for a in (q, k, jnp.asarray(x["v"]))]
    rest = (jnp.asarray(x["g"]), jnp.asarray(x["beta"]), jnp.asarray(x["state"]))
    o1, s1 = chunked_jit(*[a.astype(jnp.float32) for a in bf], *rest)
    o2, s2 = chunked_jit(*bf, *rest)
    assert o2.dtype == jnp.float32 and s2.dtype == jnp.float32
    np.testing.assert_array_equal(o2, o1)
    np.testing.assert_array_equal(s2, s1)


@pytest.mark.parametrize("t", LENGTHS)
def test_equals_transformers(t):
    x = make_inputs(t, seed=200 + t, g_max=3.0)
    tt = {n: torch.from_numpy(a) for n, a in x.items()}
    hf = {}
    for name, fn, extra in (("chunk", torch_chunk_gated_delta_rule, dict(chunk_size=64)),
                            ("recurrent", torch_recurrent_gated_delta_rule, {})):
        o, s = fn(tt["q"], tt["k"], tt["v"], tt["g"], tt["beta"], initial_state=tt["state"].clone(),
                  output_final_state=True, use_qk_l2norm_in_kernel=True, **extra)
        hf[name] = (o.numpy(), s.numpy())
    for fn in (recurrent_jit, chunked_jit):
        o, s = ours(fn, x)
        for o_hf, s_hf in hf.values():
            np.testing.assert_allclose(o, o_hf, **TOL)
            np.testing.assert_allclose(s, s_hf, **TOL)


def test_causal_conv_and_window():
    r = np.random.default_rng(1)
    b, t, c, kk, split = 3, 9, 6, 4, 4
    x = r.normal(size=(b, t, c)).astype(np.float32)
    w = r.normal(size=(c, kk)).astype(np.float32)
    full = causal_conv_silu(jnp.asarray(x), jnp.asarray(w), None)

    zeros = jnp.zeros((b, kk - 1, c), jnp.float32)
    first = causal_conv_silu(jnp.asarray(x[:, :split]), jnp.asarray(w), None)
    win = conv_window_after(zeros, jnp.asarray(x[:, :split]), jnp.full((b,), split))
    second = causal_conv_silu(jnp.asarray(x[:, split:]), jnp.asarray(w), win)
    np.testing.assert_allclose(jnp.concatenate([first, second], 1), full, rtol=1e-6, atol=1e-6)

    # transformers: [B, C, T] layout; weight [C, K] (the conv1d weight [C, 1, K] squeezed).
    xt, wt = torch.from_numpy(x).transpose(1, 2), torch.from_numpy(w)
    hf_full = causal_conv1d_fn(xt, wt, None, activation="silu").transpose(1, 2).numpy()
    np.testing.assert_allclose(full, hf_full, rtol=1e-6, atol=1e-6)
    conv_state = torch.zeros(b, c, kk - 1)
    hf_first = causal_conv1d_update(xt[:, :, :split].contiguous(), conv_state, wt, None, activation="silu")
    np.testing.assert_allclose(win, conv_state.transpose(1, 2).numpy(), rtol=0, atol=0)
    hf_second = causal_conv1d_update(xt[:, :, split:].contiguous(), conv_state, wt, None, activation="silu")
    np.testing.assert_allclose(first, hf_first.transpose(1, 2).numpy(), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(second, hf_second.transpose(1, 2).numpy(), rtol=1e-6, atol=1e-6)

    # Per-row keep counts: 0 keeps the old window, 1 shifts one input in, T keeps x's last K-1.
    old = jnp.asarray(r.normal(size=(b, kk - 1, c)).astype(np.float32))
    after = conv_window_after(old, jnp.asarray(x), jnp.array([0, 1, t]))
    np.testing.assert_array_equal(after[0], old[0])
    np.testing.assert_array_equal(after[1], jnp.concatenate([old[1, 1:], x[1, :1]], 0))
    np.testing.assert_array_equal(after[2], x[2, t - (kk - 1):])


def test_state_after_prefix():
    t = 6
    x = make_inputs(t, seed=3, g_max=2.0, b=3)
    q, k = prepare_qk(jnp.asarray(x["q"]), NV, True), prepare_qk(jnp.asarray(x["k"]), NV, False)
    v, g, beta, s0 = (jnp.asarray(x[n]) for n in ("v", "g", "beta", "state"))
    keep = np.array([0, 3, t])
    got = gated_delta_state_after(k, v, g, beta, s0, jnp.asarray(keep))
    for row, n in enumerate(keep):
        _, want = numpy_reference(   # the recurrent rule (float64) over the first n tokens only
            *(a[row:row + 1, :n] for a in (q, k, v, g, beta)), s0[row:row + 1])
        np.testing.assert_allclose(got[row], want[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("t", (8, RECURRENT_MAX_TOKENS + 1, 64))
def test_verify_block_and_commit_against_single_token_decoding(t):
    """docs/ARCHITECTURE.md (block verification): a verify block of `t` tokens (the chunked form above
    `RECURRENT_MAX_TOKENS`, the token scan up to it) gives plain decoding's outputs up to fp32
    rounding, and `target.commit`'s state (`gated_delta_state_after`, one chunk) gives plain
    decoding's state after every kept prefix up to fp32 rounding (bit for bit when nothing is
    kept), whatever the block length."""
    x = make_inputs(t, seed=t, g_max=2.0, b=3)
    q, k = prepare_qk(jnp.asarray(x["q"]), NV, True), prepare_qk(jnp.asarray(x["k"]), NV, False)
    v, g, beta, s0 = (jnp.asarray(x[n]) for n in ("v", "g", "beta", "state"))
    o_block, _ = jax.jit(gated_delta_rule)(q, k, v, g, beta, s0)
    states, outs = [s0], []
    for i in range(t):               # plain decoding: one single-token step per token
        o, s = recurrent_jit(*(a[:, i:i + 1] for a in (q, k, v, g, beta)), states[-1])
        outs.append(o)
        states.append(s)
    np.testing.assert_allclose(o_block, jnp.concatenate(outs, 1), **TOL)
    if t <= RECURRENT_MAX_TOKENS:
        np.testing.assert_array_equal(o_block, jnp.concatenate(outs, 1))
    keep = np.array([0, t // 2, t])
    committed = jax.jit(gated_delta_state_after)(k, v, g, beta, s0, jnp.asarray(keep))
    np.testing.assert_array_equal(committed[0], s0[0])
    for row, n in enumerate(keep):
        np.testing.assert_allclose(committed[row], states[n][row], **TOL)


def test_gated_rms_norm():
    r = np.random.default_rng(4)
    x, z = (r.normal(size=(2, 5, 3, 16)).astype(np.float32) for _ in range(2))
    w = r.uniform(0.5, 1.5, size=16).astype(np.float32)
    mod = Qwen3_5RMSNormGated(16, eps=1e-6)
    with torch.no_grad():
        mod.weight.copy_(torch.from_numpy(w))
        want = mod(torch.from_numpy(x), torch.from_numpy(z)).numpy()
    got = gated_rms_norm(jnp.asarray(x), jnp.asarray(z), jnp.asarray(w), 1e-6)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def _loss(fn, ct, q, k, v, g, beta, state):
    o, s = fn(prepare_qk(q, NV, True), prepare_qk(k, NV, False), v, g, beta, state)
    return jnp.sum(o * ct) + jnp.sum(s * s)


_GRADS = {name: jax.jit(jax.grad(lambda *a, fn=fn: _loss(fn, *a), argnums=tuple(range(1, 7))))
          for name, fn in (("chunked", gated_delta_chunked), ("recurrent", gated_delta_recurrent))}


def test_grad_finite_and_matches_recurrent():
    t = 70   # two chunks, the second padded
    ct = jnp.asarray(np.random.default_rng(5).normal(size=(B, t, NV, DV)).astype(np.float32))
    for g_max in (1.0, 20.0):
        x = make_inputs(t, seed=9, g_max=g_max)
        x["g"][:, 10:20] = 0.0   # a masked stretch
        x["beta"][:, 10:20] = 0.0
        args = tuple(jnp.asarray(x[n]) for n in ("q", "k", "v", "g", "beta", "state"))
        grads = {name: f(ct, *args) for name, f in _GRADS.items()}
        for gc, gr in zip(grads["chunked"], grads["recurrent"]):
            assert np.isfinite(np.asarray(gc)).all()
            np.testing.assert_allclose(gc, gr, rtol=1e-4, atol=1e-4)
