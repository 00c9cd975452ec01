"""The Gemma 4 text target (`gemma4`, `gemma4_text`): sliding and full attention layers of their own
sizes, as layers of the same target module and cache protocol as the Qwen families.

A layer is the sandwich block

    x = x + RMS_post_attn(attn(RMS_in(x)));  x = (x + RMS_post_ff(mlp(RMS_pre_ff(x)))) * layer_scalar

with a gelu-tanh gated MLP and `GemmaAttention`: per-head q / k RMSNorms, an unscaled RMSNorm on v,
softmax scale 1 (queries are multiplied by `sqrt(D)` before the kernels' `D^-0.5`). Sliding layers
use the stack's `head_dim`, K/V heads and plain RoPE, with the window `q - k < sliding_window`; full
layers their own `global_head_dim` / K/V heads (keys double as values under `attention_k_eq_v`)
and proportional RoPE (`rope.proportional_cos_sin`). Embeddings are scaled by `sqrt(hidden)`
(`embed` is the target's input embedding, as the MTP protocol and DFlash read it) and logits
soft-capped `cap * tanh(l / cap)`.

Both layer types share one cache array (`TargetConfig.kv_cache_dims`): a layer's K/V `[kv, D]`
are stored as `kv * D / dim` heads of the common `dim` (gcd of the two head dims), repeated (or
zero-padded) to the cache's head count (`pack_heads` / `unpack_heads`). Cache layer == layer index (every layer
attends).

Example:
    >>> from dmtp_jax.config import TargetConfig
    >>> cfg = TargetConfig.from_hf_dict({"model_type": "gemma4_text", "vocab_size": 64, "hidden_size": 16,
    ...     "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
    ...     "num_key_value_heads": 1, "head_dim": 8, "global_head_dim": 16, "sliding_window": 4,
    ...     "hidden_size_per_layer_input": 0})
    >>> model = GemmaTarget(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))
    >>> model.logits(model(jnp.zeros((1, 3), jnp.int32), jnp.arange(3)[None]).hidden_bth).shape
    (1, 3, 64)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dmtp_jax.config import TargetConfig
from dmtp_jax.layers import params
from dmtp_jax.layers.attention import MaskRule, grouped_attention
from dmtp_jax.layers.kv_cache import KVCache, repeat_kv_heads, write_layer
from dmtp_jax.layers.norms import rms_norm
from dmtp_jax.layers.rope import apply_rope, proportional_cos_sin
from dmtp_jax.models.qwen3 import DecoderLayer, DenseMLP, QwenTarget
from dmtp_jax.sharding import MeshRules


def gelu_tanh(x):
    return jax.nn.gelu(x, approximate=True)


def pack_heads(x_btkd: jax.Array, heads: int, dim: int) -> jax.Array:
    """`[B, T, kv, D]` as `[B, T, heads, dim]`: each KV head is `r = D / dim` heads of `dim`; when
    `kv * r` divides `heads`, each KV head's `r` pieces are repeated to fill `heads / kv` consecutive
    slots (so a `tensor` shard of the cache holds whole KV heads, the ones its query heads read),
    else they are zero-padded to `heads`.

    Example:
        >>> pack_heads(jnp.arange(4.0).reshape(1, 1, 1, 4), 4, 2)[0, 0].tolist()
        [[0.0, 1.0], [2.0, 3.0], [0.0, 1.0], [2.0, 3.0]]
    """
    b, t, kv, d = x_btkd.shape
    r = d // dim
    if heads % (kv * r) == 0:
        return repeat_kv_heads(x_btkd, heads // r).reshape(b, t, heads, dim)
    x = x_btkd.reshape(b, t, kv * r, dim)
    return jnp.pad(x, ((0, 0), (0, 0), (0, heads - kv * r), (0, 0)))


def unpack_heads(x_bshd: jax.Array, kv: int, d: int, num_heads: int) -> jax.Array:
    """A cache layer `[B, S, H, dim]` that `pack_heads` wrote as the `[B, S, kv', d]` K/V attention
    reads: with the repeated layout and `kv * copies` dividing the `num_heads` query heads, every copy
    is a KV head of its own (`kv' = kv * copies`, the layout `kv_cache.repeat_kv_heads` gives: each
    query head reads a copy of its KV head held on its own shard), else the first copy (`kv' = kv`)."""
    b, s, h, dim = x_bshd.shape
    r = d // dim
    if h % (kv * r):
        return x_bshd[:, :, :kv * r].reshape(b, s, kv, d)
    copies = h // (kv * r)
    if num_heads % (kv * copies) == 0:
        return x_bshd.reshape(b, s, kv * copies, d)
    return x_bshd.reshape(b, s, kv, copies, d)[:, :, :, 0]


def gemma_norm(x, weight, eps):
    """Gemma 4's RMSNorm: `x / rms(x) * w` (`weight` None: no scale, the values' norm)."""
    if weight is None:
        x32 = x.astype(jnp.float32)
        return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype)
    return rms_norm(x, weight, eps)


class GemmaAttention(nnx.Module):
    """Gemma 4 attention with the `qwen3.Attention` interface (`q_gate`, `kv`, `write`, `attend_cache`,
    `__call__`). `kv_shared`: no K/V projections (the assistant's layers read a target's K/V, a sliding
    one the last `sliding_window + 1` positions before its query, as transformers' assistant masks them)."""

    def __init__(self, cfg: TargetConfig, layer: int, dtype, rngs: nnx.Rngs, *, kv_shared: bool = False):
        g = cfg.gemma
        self.full = cfg.layer_types[layer] == "full_attention"
        h, nh = cfg.hidden_size, cfg.num_attention_heads
        self.head_dim = g.global_head_dim if self.full else cfg.head_dim
        self.num_heads = nh
        self.num_kv_heads = g.global_kv_heads if self.full else cfg.num_key_value_heads
        self.window = None if self.full else cfg.sliding_window + (1 if kv_shared else 0)
        self.eps = cfg.rms_norm_eps
        self.rope = ((g.global_rope_theta, g.global_rotary_factor) if self.full else (cfg.rope_theta, 1.0))
        self.cache_dim = cfg.kv_cache_dims[2]
        d, kv = self.head_dim, self.num_kv_heads
        self.q_proj = params.weight(rngs, (h, nh * d), ("embed", "heads"), dtype)
        self.q_norm = params.ones((d,), (None,), dtype)
        self.o_proj = params.weight(rngs, (nh * d, h), ("heads", "embed"), dtype)
        self.kv_shared = kv_shared
        self.k_eq_v = self.full and g.k_eq_v
        if not kv_shared:
            self.k_proj = params.weight(rngs, (h, kv * d), ("embed", "kv_heads"), dtype)
            self.k_norm = params.ones((d,), (None,), dtype)
            if not self.k_eq_v:
                self.v_proj = params.weight(rngs, (h, kv * d), ("embed", "kv_heads"), dtype)

    def cos_sin(self, positions_bt, dtype):
        """This layer type's RoPE tables `[B, T, D]`."""
        theta, factor = self.rope
        return proportional_cos_sin(positions_bt, self.head_dim, theta, factor, dtype)

    def q_gate(self, x_bth, cos, sin):
        """Normed, rotated queries `[B, T, nh, D]` times `sqrt(D)` (softmax scale 1) and no gate."""
        b, t, _ = x_bth.shape
        q = gemma_norm((x_bth @ self.q_proj[...]).reshape(b, t, self.num_heads, self.head_dim), self.q_norm[...],
                       self.eps)
        return apply_rope(q, cos, sin) * jnp.asarray(self.head_dim ** 0.5, q.dtype), None

    def kv(self, x_bth, cos, sin):
        """Keys (normed, rotated) and values (unscaled norm), both `[B, T, kv, D]`."""
        b, t, _ = x_bth.shape
        shape = (b, t, self.num_kv_heads, self.head_dim)
        k = (x_bth @ self.k_proj[...]).reshape(shape)
        v = k if self.k_eq_v else (x_bth @ self.v_proj[...]).reshape(shape)
        return apply_rope(gemma_norm(k, self.k_norm[...], self.eps), cos, sin), gemma_norm(v, None, self.eps)

    def out(self, attn_bthd):
        b, t = attn_bthd.shape[:2]
        return attn_bthd.reshape(b, t, -1) @ self.o_proj[...]

    def write(self, cache: KVCache, kv_index, k_btkd, v_btkd, positions_bt) -> KVCache:
        """The cache with this layer's K/V packed into cache layer `kv_index` (heads of the cache's
        own count: the model's, or more on a wide `tensor` axis) at slot == position."""
        pack = lambda x: pack_heads(x, cache.k_lbskd.shape[3], self.cache_dim)  # noqa: E731
        return KVCache(write_layer(cache.k_lbskd, kv_index, pack(k_btkd), positions_bt),
                       write_layer(cache.v_lbskd, kv_index, pack(v_btkd), positions_bt))

    def layer_kv(self, cache: KVCache, kv_index):
        """Cache layer `kv_index`'s keys and values as this layer's `[B, S, kv', D]` (`unpack_heads`)."""
        unpack = lambda x: unpack_heads(x[kv_index], self.num_kv_heads, self.head_dim, self.num_heads)  # noqa: E731
        return unpack(cache.k_lbskd), unpack(cache.v_lbskd)

    def attend_cache(self, q_bthd, gate_btf, positions_bt, cache: KVCache, kv_index, key_limit_bt=None):
        """Output of queries at `positions_bt` over cache layer `kv_index` (causal, window). `key_limit_bt`:
        the last key position each query reads (default its own position; the assistant's is one less)."""
        keys, values = self.layer_kv(cache, kv_index)
        limit = positions_bt if key_limit_bt is None else key_limit_bt
        rule = MaskRule.over_slots(limit, cache.max_len, window=self.window)
        return self.out(grouped_attention(q_bthd, keys, values, rule))

    def __call__(self, x_bth, positions_bt, cos, sin, cache: KVCache | None, kv_valid_bt, kv_index=0):
        """Attention of the new tokens: over each other without a cache, else written to and read from
        cache layer `kv_index`. `cos` / `sin` (the stack's plain tables) are recomputed for this layer type."""
        cos, sin = self.cos_sin(positions_bt, x_bth.dtype)
        q, _ = self.q_gate(x_bth, cos, sin)
        k, v = self.kv(x_bth, cos, sin)
        if cache is None:
            rule = MaskRule(positions_bt, positions_bt, kv_valid_bt, causal=True, window=self.window, self_keys=True)
            return self.out(grouped_attention(q, k, v, rule)), cache
        cache = self.write(cache, kv_index, k, v, positions_bt)
        return self.attend_cache(q, None, positions_bt, cache, kv_index), cache


class GemmaDecoderLayer(DecoderLayer):
    """The sandwich-norm Gemma 4 block (module docstring); `kv_shared`: see `GemmaAttention`."""

    def __init__(self, cfg: TargetConfig, layer: int, dtype, rngs: nnx.Rngs, *, first_key_slot: int = 0,
                 stacked: bool = True, mesh_rules: MeshRules | None = None, kv_shared: bool = False):
        self.eps, self.zero_centred, self.is_linear = cfg.rms_norm_eps, False, False
        h = cfg.hidden_size
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            setattr(self, name, params.ones((h,), (None,), dtype))
        self.layer_scalar = params.ones((1,), (None,), dtype)
        self.self_attn = GemmaAttention(cfg, layer, dtype, rngs, kv_shared=kv_shared)
        self.mlp = DenseMLP(h, cfg.intermediate_size, dtype, rngs, act=gelu_tanh)

    def finish(self, x, mixed):
        """The rest of the block after the attention output `mixed` (before its post-norm)."""
        x = x + self.norm(mixed, self.post_attention_layernorm)
        with jax.named_scope("mlp"):
            x = x + self.norm(self.mlp(self.norm(x, self.pre_feedforward_layernorm)), self.post_feedforward_layernorm)
        return x * self.layer_scalar[...]

    def __call__(self, x, positions_bt, cos, sin, cache: KVCache | None, kv_valid_bt, kv_index=0):
        with jax.named_scope("attention"):
            attn, cache = self.self_attn(self.norm(x, self.input_layernorm), positions_bt, cos, sin, cache,
                                         kv_valid_bt, kv_index)
        return self.finish(x, attn), cache


class GemmaTarget(QwenTarget):
    """A Gemma 4 text causal LM: `QwenTarget` with `GemmaDecoderLayer`s, scaled input embeddings and
    soft-capped logits."""
    decoder_layer = GemmaDecoderLayer

    def embed(self, tokens_bt: jax.Array) -> jax.Array:
        """The target's input embeddings: rows times `sqrt(hidden)` (in the table's dtype, as transformers)."""
        rows = jnp.take(self.embed_tokens[...], tokens_bt, axis=0)
        return rows * jnp.asarray(self.cfg.hidden_size ** 0.5, rows.dtype)

    def logits(self, hidden: jax.Array) -> jax.Array:
        """fp32 logits, soft-capped `cap * tanh(l / cap)` when the config caps them."""
        logits = super().logits(hidden)
        cap = self.cfg.gemma.final_logit_softcapping
        return cap * jnp.tanh(logits / cap) if cap else logits
