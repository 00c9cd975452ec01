"""DeepSeek-V3 and GLM-4.7-Flash (`glm4_moe_lite`) targets: `QwenTarget` with MLA attention over a
latent cache (`layers/mla.py`) and the DeepSeek MoE (`layers/moe.py`), same cache protocol; the
MTP head's layer is an `MlaDecoderLayer` too. Layer details: docs/models-detail.md.

Example:
    >>> from dmtp_jax.config import TargetConfig
    >>> cfg = TargetConfig.from_hf_dict({"model_type": "deepseek_v3", "vocab_size": 64, "hidden_size": 16,
    ...     "intermediate_size": 32, "moe_intermediate_size": 8, "num_hidden_layers": 2,
    ...     "num_attention_heads": 2, "kv_lora_rank": 8, "q_lora_rank": None, "qk_rope_head_dim": 4,
    ...     "qk_nope_head_dim": 8, "v_head_dim": 8, "n_routed_experts": 4, "num_experts_per_tok": 2,
    ...     "n_group": 2, "topk_group": 1, "first_k_dense_replace": 1})
    >>> model = DeepSeekTarget(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))
    >>> model.logits(model(jnp.zeros((1, 3), jnp.int32), jnp.arange(3)[None]).hidden_bth).shape
    (1, 3, 64)
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from dmtp_jax.config import TargetConfig
from dmtp_jax.layers import params
from dmtp_jax.layers.attention import MaskRule
from dmtp_jax.layers.kv_cache import KVCache, write_layer
from dmtp_jax.layers.mla import absorbed_query, deinterleave, latent_attention, split_kv_b
from dmtp_jax.layers.moe import grouped_sigmoid_top_k, moe_mlp
from dmtp_jax.layers.norms import rms_norm
from dmtp_jax.layers.rope import apply_rope, yarn_softmax_scale
from dmtp_jax.models.qwen3 import DecoderLayer, DenseMLP, QwenTarget
from dmtp_jax.sharding import MeshRules


class MlaAttention(nnx.Module):
    """Multi-head latent attention with the `qwen3.Attention` interface the layer stack and the MTP
    head call (`q_gate`, `kv`, `write`, `attend_cache`, `__call__`); its "k" is the latent and its
    "v" zero-wide, so `write` stores only the latent. The cache layer `kv_index` is an argument."""

    def __init__(self, cfg: TargetConfig, layer: int, dtype, rngs: nnx.Rngs, *, first_key_slot: int = 0):
        h, nh = cfg.hidden_size, cfg.num_attention_heads
        self.first_key_slot = first_key_slot
        self.num_heads, self.eps, self.interleave = nh, cfg.rms_norm_eps, cfg.rope_interleave
        self.nope, self.rope, self.rank = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
        self.scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5 * yarn_softmax_scale(dict(cfg.rope_scaling))
        q_dim = nh * (self.nope + self.rope)
        self.low_rank_q = cfg.q_lora_rank > 0
        if self.low_rank_q:
            self.q_a_proj = params.weight(rngs, (h, cfg.q_lora_rank), ("embed", None), dtype)
            self.q_a_layernorm = params.ones((cfg.q_lora_rank,), (None,), dtype)
            self.q_b_proj = params.weight(rngs, (cfg.q_lora_rank, q_dim), (None, "heads"), dtype)
        else:
            self.q_proj = params.weight(rngs, (h, q_dim), ("embed", "heads"), dtype)
        self.kv_a_proj_with_mqa = params.weight(rngs, (h, self.rank + self.rope), ("embed", None), dtype)
        self.kv_a_layernorm = params.ones((self.rank,), (None,), dtype)
        self.kv_b_proj = params.weight(rngs, (self.rank, nh * (self.nope + cfg.v_head_dim)), (None, "heads"), dtype)
        self.o_proj = params.weight(rngs, (nh * cfg.v_head_dim, h), ("heads", "embed"), dtype)

    def _rotate(self, x, cos, sin):
        return apply_rope(deinterleave(x) if self.interleave else x, cos, sin)

    def q_gate(self, x_bth, cos, sin):
        """The absorbed, pre-scaled queries `[B, T, heads, r + rope]` (`layers/mla.py`) and no gate."""
        b, t, _ = x_bth.shape
        if self.low_rank_q:
            q = rms_norm(x_bth @ self.q_a_proj[...], self.q_a_layernorm[...], self.eps) @ self.q_b_proj[...]
        else:
            q = x_bth @ self.q_proj[...]
        q = q.reshape(b, t, self.num_heads, self.nope + self.rope)
        w_uk, _ = split_kv_b(self.kv_b_proj[...], self.num_heads, self.nope)
        return absorbed_query(q[..., :self.nope], self._rotate(q[..., self.nope:], cos, sin), w_uk, self.scale), None

    def kv(self, x_bth, cos, sin):
        """The latent `[B, T, 1, r + rope]` (normed compressed K/V, rotated shared key) and a zero-wide value."""
        b, t, _ = x_bth.shape
        c = x_bth @ self.kv_a_proj_with_mqa[...]
        c_kv = rms_norm(c[..., :self.rank], self.kv_a_layernorm[...], self.eps)
        k_rot = self._rotate(c[..., None, self.rank:], cos, sin)
        latent = jnp.concatenate([c_kv[:, :, None, :], k_rot.astype(c_kv.dtype)], axis=-1)
        return latent, jnp.zeros((b, t, 1, 0), latent.dtype)

    def out(self, heads_bthv):
        b, t = heads_bthv.shape[:2]
        return heads_bthv.reshape(b, t, -1) @ self.o_proj[...]

    def _attend(self, q_bthl, latent_bs1l, rule):
        _, w_uv = split_kv_b(self.kv_b_proj[...], self.num_heads, self.nope)
        return self.out(latent_attention(q_bthl, latent_bs1l, w_uv.astype(q_bthl.dtype), rule))

    def write(self, cache: KVCache, kv_index, k_btkd, v_btkd, positions_bt) -> KVCache:
        """The cache with this layer's new latents (cache layer `kv_index`, a Python int or a traced
        scalar) at their positions (slot == position)."""
        return KVCache(write_layer(cache.k_lbskd, kv_index, k_btkd, positions_bt),
                       write_layer(cache.v_lbskd, kv_index, v_btkd, positions_bt))

    def attend_cache(self, q_bthl, gate_btf, positions_bt, cache: KVCache, kv_index):
        """Output of queries at `positions_bt` over cache layer `kv_index`'s latents (causal, never a
        slot below `first_key_slot`); `gate_btf` is always None."""
        rule = MaskRule.over_slots(positions_bt, cache.max_len, self.first_key_slot)
        return self._attend(q_bthl, cache.k_lbskd[kv_index], rule)

    def __call__(self, x_bth, positions_bt, cos, sin, cache: KVCache | None, kv_valid_bt, kv_index=0):
        """Attention of the new tokens: over each other without a cache, else written to and read
        from cache layer `kv_index`."""
        q, _ = self.q_gate(x_bth, cos, sin)
        latent, empty = self.kv(x_bth, cos, sin)
        if cache is None:
            rule = MaskRule(positions_bt, positions_bt, kv_valid_bt, causal=True, self_keys=True)
            return self._attend(q, latent, rule), cache
        cache = self.write(cache, kv_index, latent, empty, positions_bt)
        return self.attend_cache(q, None, positions_bt, cache, kv_index), cache


class DeepSeekMoE(nnx.Module):
    """Routed experts (`grouped_sigmoid_top_k`) plus the always-on shared experts (one SwiGLU of
    `n_shared_experts * moe_intermediate_size`). `stacked` and `mesh_rules` as in `qwen3.SparseMoE`."""

    def __init__(self, cfg: TargetConfig, dtype, rngs: nnx.Rngs, stacked: bool = True,
                 mesh_rules: MeshRules | None = None):
        self.stacked, self.mesh_rules = stacked, mesh_rules
        h, e, i = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
        self.top_k, self.norm_topk_prob = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.n_group, self.topk_group, self.scaling = cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor
        self.router = params.weight(rngs, (h, e), ("embed", None), dtype)
        self.e_score_correction_bias = params.zeros((e,), (None,), dtype)
        self.gate_proj = params.weight(rngs, (e, h, i), ("experts", "embed", "mlp"), dtype)
        self.up_proj = params.weight(rngs, (e, h, i), ("experts", "embed", "mlp"), dtype)
        self.down_proj = params.weight(rngs, (e, i, h), ("experts", "mlp", "embed"), dtype)
        self.has_shared = cfg.shared_expert
        if self.has_shared:
            self.shared_experts = DenseMLP(h, cfg.shared_expert_intermediate_size, dtype, rngs)

    def __call__(self, x_bth):
        b, t, h = x_bth.shape
        x = x_bth.reshape(b * t, h)
        routing = grouped_sigmoid_top_k(x, self.router[...], self.e_score_correction_bias[...], self.top_k,
                                        self.n_group, self.topk_group, self.norm_topk_prob, self.scaling)
        y = moe_mlp(x, self.router[...], self.gate_proj[...], self.up_proj[...], self.down_proj[...],
                    self.top_k, self.norm_topk_prob, stacked=self.stacked, rules=self.mesh_rules, routing=routing)
        if self.has_shared:
            y = y + self.shared_experts(x)
        return y.reshape(b, t, h)


class MlaDecoderLayer(DecoderLayer):
    """`qwen3.DecoderLayer` (its `norm`, `finish`, `__call__`) with `MlaAttention` and the DeepSeek
    MLP: `DeepSeekMoE` where `cfg.is_moe_layer`, else a dense SwiGLU of `intermediate_size`."""

    def __init__(self, cfg: TargetConfig, layer: int, dtype, rngs: nnx.Rngs, *, first_key_slot: int = 0,
                 stacked: bool = True, mesh_rules: MeshRules | None = None):
        self.eps, self.zero_centred, self.is_linear = cfg.rms_norm_eps, False, False
        self.input_layernorm = params.ones((cfg.hidden_size,), (None,), dtype)
        self.post_attention_layernorm = params.ones((cfg.hidden_size,), (None,), dtype)
        self.self_attn = MlaAttention(cfg, layer, dtype, rngs, first_key_slot=first_key_slot)
        self.mlp = (DeepSeekMoE(cfg, dtype, rngs, stacked, mesh_rules) if cfg.is_moe_layer(layer)
                    else DenseMLP(cfg.hidden_size, cfg.intermediate_size, dtype, rngs))


class DeepSeekTarget(QwenTarget):
    """A DeepSeek-V3 / GLM-4.7-Flash causal LM: `QwenTarget` whose layers are `MlaDecoderLayer`s."""
    decoder_layer = MlaDecoderLayer


def decoder_layer_class(cfg: TargetConfig) -> type[DecoderLayer]:
    """The decoder layer of a target config's family (the MTP head builds its layer with it)."""
    return MlaDecoderLayer if cfg.is_mla else DecoderLayer

