"""Qwen3 dense and Qwen3-MoE targets as NNX modules, run as pure functions.

One forward serves prefill, single-token decode, multi-token verify and training: it takes new
tokens at explicit per-row positions, and either a static KV cache (slot == position) or none (the
tokens attend only to each other). On request it returns the hidden states after chosen layers
(HF `hidden_states[k+1]`, the DFlash context features; like HF, the last layer's entry is the
post-final-norm state) next to the post-final-norm hidden state
(the MTP input).

Example:
    >>> from dmtp_jax.config import TargetConfig
    >>> cfg = TargetConfig.from_hf_dict({"model_type": "qwen3", "vocab_size": 64, "hidden_size": 16,
    ...     "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
    ...     "num_key_value_heads": 1, "head_dim": 8})
    >>> model = Qwen3Target(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))
    >>> out = model(jnp.zeros((1, 3), jnp.int32), jnp.arange(3)[None])
    >>> model.logits(out.hidden_bth).shape
    (1, 3, 64)
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from dmtp_jax.config import TargetConfig
from dmtp_jax.layers import params
from dmtp_jax.layers.attention import attention_mask, grouped_attention
from dmtp_jax.layers.kv_cache import KVCache, write_layer
from dmtp_jax.layers.mlp import moe_mlp, swiglu
from dmtp_jax.layers.norms import rms_norm
from dmtp_jax.layers.rope import apply_rope, rope_cos_sin


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TargetOutput:
    hidden_bth: jax.Array                 # post-final-norm hidden (MTP input, LM head input)
    captured: tuple[jax.Array, ...]       # outputs of the requested layers, [B, T, H] each
    cache: KVCache | None


class Attention(nnx.Module):
    def __init__(self, cfg: TargetConfig, layer: int, dtype, rngs: nnx.Rngs):
        h, nh, kv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = nh, kv, hd
        self.eps = cfg.rms_norm_eps
        self.window = cfg.sliding_window if cfg.layer_types[layer] == "sliding_attention" else None
        self.q_proj = params.weight(rngs, (h, nh * hd), ("embed", "heads"), dtype)
        self.k_proj = params.weight(rngs, (h, kv * hd), ("embed", "kv_heads"), dtype)
        self.v_proj = params.weight(rngs, (h, kv * hd), ("embed", "kv_heads"), dtype)
        self.o_proj = params.weight(rngs, (nh * hd, h), ("heads", "embed"), dtype)
        self.has_bias = cfg.attention_bias
        if cfg.attention_bias:
            self.q_bias = params.zeros((nh * hd,), ("heads",), dtype)
            self.k_bias = params.zeros((kv * hd,), ("kv_heads",), dtype)
            self.v_bias = params.zeros((kv * hd,), ("kv_heads",), dtype)
            self.o_bias = params.zeros((h,), (None,), dtype)
        self.q_norm = params.ones((hd,), (None,), dtype)
        self.k_norm = params.ones((hd,), (None,), dtype)

    def qkv(self, x_bth, cos, sin):
        """Projected, per-head normed and rotated q `[B,T,nh,D]`, k and v `[B,T,kv,D]`."""
        b, t, _ = x_bth.shape
        q, k, v = x_bth @ self.q_proj[...], x_bth @ self.k_proj[...], x_bth @ self.v_proj[...]
        if self.has_bias:
            q, k, v = q + self.q_bias[...], k + self.k_bias[...], v + self.v_bias[...]
        q = rms_norm(q.reshape(b, t, self.num_heads, self.head_dim), self.q_norm[...], self.eps)
        k = rms_norm(k.reshape(b, t, self.num_kv_heads, self.head_dim), self.k_norm[...], self.eps)
        v = v.reshape(b, t, self.num_kv_heads, self.head_dim)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def out(self, attn_bthd):
        b, t = attn_bthd.shape[:2]
        y = attn_bthd.reshape(b, t, -1) @ self.o_proj[...]
        return y + self.o_bias[...] if self.has_bias else y

    def __call__(self, x_bth, positions_bt, cos, sin, cache: KVCache | None, kv_valid_bt):
        q, k, v = self.qkv(x_bth, cos, sin)
        if cache is None:
            keys, values, k_pos, valid = k, v, positions_bt, kv_valid_bt
        else:
            cache = KVCache(write_layer(cache.k_lbskd, self.layer, k, positions_bt),
                            write_layer(cache.v_lbskd, self.layer, v, positions_bt))
            keys, values = cache.k_lbskd[self.layer], cache.v_lbskd[self.layer]
            k_pos = jnp.broadcast_to(jnp.arange(cache.max_len), keys.shape[:2])
            valid = None
        mask = attention_mask(positions_bt, k_pos, valid, True, self.window)
        return self.out(grouped_attention(q, keys, values, mask)), cache


class DenseMLP(nnx.Module):
    def __init__(self, h: int, inter: int, dtype, rngs: nnx.Rngs):
        self.gate_proj = params.weight(rngs, (h, inter), ("embed", "mlp"), dtype)
        self.up_proj = params.weight(rngs, (h, inter), ("embed", "mlp"), dtype)
        self.down_proj = params.weight(rngs, (inter, h), ("mlp", "embed"), dtype)

    def __call__(self, x):
        return swiglu(x, self.gate_proj[...], self.up_proj[...], self.down_proj[...])


class SparseMoE(nnx.Module):
    def __init__(self, cfg: TargetConfig, dtype, rngs: nnx.Rngs):
        h, e, i = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
        self.top_k, self.norm_topk_prob = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.router = params.weight(rngs, (h, e), ("embed", None), dtype)
        self.gate_proj = params.weight(rngs, (e, h, i), ("experts", "embed", "mlp"), dtype)
        self.up_proj = params.weight(rngs, (e, h, i), ("experts", "embed", "mlp"), dtype)
        self.down_proj = params.weight(rngs, (e, i, h), ("experts", "mlp", "embed"), dtype)

    def __call__(self, x_bth):
        b, t, h = x_bth.shape
        y = moe_mlp(x_bth.reshape(b * t, h), self.router[...], self.gate_proj[...], self.up_proj[...],
                    self.down_proj[...], self.top_k, self.norm_topk_prob)
        return y.reshape(b, t, h)


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: TargetConfig, layer: int, dtype, rngs: nnx.Rngs):
        self.eps = cfg.rms_norm_eps
        self.input_layernorm = params.ones((cfg.hidden_size,), (None,), dtype)
        self.post_attention_layernorm = params.ones((cfg.hidden_size,), (None,), dtype)
        self.self_attn = Attention(cfg, layer, dtype, rngs)
        self.mlp = (SparseMoE(cfg, dtype, rngs) if cfg.is_moe_layer(layer)
                    else DenseMLP(cfg.hidden_size, cfg.intermediate_size, dtype, rngs))

    def __call__(self, x, positions_bt, cos, sin, cache, kv_valid_bt):
        attn, cache = self.self_attn(rms_norm(x, self.input_layernorm[...], self.eps), positions_bt,
                                     cos, sin, cache, kv_valid_bt)
        x = x + attn
        x = x + self.mlp(rms_norm(x, self.post_attention_layernorm[...], self.eps))
        return x, cache


class Qwen3Target(nnx.Module):
    """A Qwen3 / Qwen3-MoE causal LM. Params use `[in, out]` kernels; HF names map in `checkpoint.hf`."""

    def __init__(self, cfg: TargetConfig, *, dtype, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed_tokens = params.weight(rngs, (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), dtype)
        self.layers = nnx.List([DecoderLayer(cfg, i, dtype, rngs) for i in range(cfg.num_hidden_layers)])
        self.norm = params.ones((cfg.hidden_size,), (None,), dtype)
        if not cfg.tie_word_embeddings:
            self.lm_head = params.weight(rngs, (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"), dtype)

    @property
    def dtype(self):
        return self.embed_tokens[...].dtype

    def embed(self, tokens_bt: jax.Array) -> jax.Array:
        """Raw embedding rows (no scaling), shared with MTP and DFlash."""
        return jnp.take(self.embed_tokens[...], tokens_bt, axis=0)

    def logits(self, hidden: jax.Array) -> jax.Array:
        """LM head on post-norm hidden states (tied embeddings when the config says so)."""
        if self.cfg.tie_word_embeddings:
            return jnp.einsum("...h,vh->...v", hidden, self.embed_tokens[...])
        return hidden @ self.lm_head[...]

    def __call__(self, tokens_bt: jax.Array, positions_bt: jax.Array, cache: KVCache | None = None,
                 *, capture_layers: tuple[int, ...] = (), kv_valid_bt: jax.Array | None = None,
                 embeds_bth: jax.Array | None = None) -> TargetOutput:
        """Runs new tokens at `positions [B, T]`.

        With `cache`, K/V are written at slot == position and every key `<=` the query position is
        read; without, the tokens attend causally to each other (`kv_valid_bt` masks padding).
        `embeds_bth` replaces the embedding lookup when given.
        """
        x = self.embed(tokens_bt) if embeds_bth is None else embeds_bth
        cos, sin = rope_cos_sin(positions_bt, self.cfg.head_dim, self.cfg.rope_theta, x.dtype)
        by_layer = {}
        for i, layer in enumerate(self.layers):
            x, cache = layer(x, positions_bt, cos, sin, cache, kv_valid_bt)
            if i in capture_layers:
                by_layer[i] = x
        hidden = rms_norm(x, self.norm[...], self.cfg.rms_norm_eps)
        last = len(self.layers) - 1
        if last in by_layer:          # HF's hidden_states[L] is the post-norm state
            by_layer[last] = hidden
        return TargetOutput(hidden, tuple(by_layer[i] for i in capture_layers), cache)
