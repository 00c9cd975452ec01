"""SwiGLU MLP and the Qwen3-MoE sparse block (top-k softmax router)."""

import jax
import jax.numpy as jnp


def swiglu(x: jax.Array, gate_hi: jax.Array, up_hi: jax.Array, down_ih: jax.Array) -> jax.Array:
    """`down(silu(gate(x)) * up(x))` with kernels stored `[in, out]`."""
    return (jax.nn.silu(x @ gate_hi) * (x @ up_hi)) @ down_ih


def moe_routing(x_nh: jax.Array, router_he: jax.Array, top_k: int, norm_topk_prob: bool) -> jax.Array:
    """Dense combine weights `[N, E]`: softmax (fp32) over experts, kept on the top-k, optionally
    renormalised; zeros elsewhere. Same selection and weights as transformers' Qwen3MoeTopKRouter."""
    probs = jax.nn.softmax((x_nh @ router_he).astype(jnp.float32), axis=-1)
    top_vals, top_idx = jax.lax.top_k(probs, top_k)
    if norm_topk_prob:
        top_vals = top_vals / jnp.sum(top_vals, axis=-1, keepdims=True)
    onehot = jax.nn.one_hot(top_idx, probs.shape[-1], dtype=jnp.float32)
    return jnp.einsum("nk,nke->ne", top_vals, onehot).astype(x_nh.dtype)


def moe_mlp(x_nh: jax.Array, router_he: jax.Array, gate_ehi: jax.Array, up_ehi: jax.Array,
            down_eih: jax.Array, top_k: int, norm_topk_prob: bool) -> jax.Array:
    """Sparse MoE MLP computed densely over experts (exact; each expert sees every token and the
    combine weights zero the unselected ones). Fine for small expert counts and decode batches;
    a grouped/ragged kernel is the optimisation for large E."""
    combine_ne = moe_routing(x_nh, router_he, top_k, norm_topk_prob)
    h = jax.nn.silu(jnp.einsum("nh,ehi->nei", x_nh, gate_ehi)) * jnp.einsum("nh,ehi->nei", x_nh, up_ehi)
    out_neh = jnp.einsum("nei,eih->neh", h, down_eih)
    return jnp.einsum("neh,ne->nh", out_neh, combine_ne)
