"""Native MTP head (Qwen3.5 / Qwen3-Next / Qwen3.6 `mtp.*` format) for a Qwen-family target.

One MTP step predicts token t+2 from the target's post-final-norm hidden state at t and the token at
t+1 (the row sits at position t+1, transformers' `MtpModel` convention):

    u = fc([RMS_e(embed(x_{t+1})) ; RMS_h(h_t)])        # embedding first
    h = decoder_layer(u)                               # the target's own layer type, own KV cache
    y = norm(h);  logits = target.logits(y)            # the target's LM head, fp32 out

Chained steps feed `y` back as the next step's hidden input. The layer is the target's own
full-attention layer type, exactly as `transformers.modeling_layers.MtpModel` builds it: on a
Qwen3 target a Qwen3 layer with plain RMSNorms; on a hybrid target (Qwen3.5 / Qwen3.6 / Qwen3-Next)
a gated full-attention layer with partial RoPE, the target's MLP kind (dense, or MoE with its shared
expert) and zero-centred `(1 + w)` norms everywhere (the MTP's own four too).

The MTP's rows start at position 1 (row `(h_0, x_1)`), so cache slot 0 is never written and never
read as a key.

Example:
    >>> head = MtpHead(mtp_config_for(cfg), dtype=jnp.float32, rngs=nnx.Rngs(0))  # doctest: +SKIP
    >>> h, cache = head(embeds_bth, hidden_bth, positions_bt, cache)  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from dmtp_jax.config import TargetConfig
from dmtp_jax.layers import params
from dmtp_jax.layers.kv_cache import KVCache
from dmtp_jax.layers.norms import rms_norm
from dmtp_jax.layers.rope import rope_cos_sin
from dmtp_jax.models.qwen3 import DecoderLayer


@dataclasses.dataclass(frozen=True)
class MtpConfig:
    """The MTP head of a target: its decoder layer is a 1-layer, full-attention copy of the target's
    layer config (whose `zero_centred_norms` also sets the MTP's own norms)."""
    layer_cfg: TargetConfig

    @property
    def zero_centred(self) -> bool:
        return self.layer_cfg.zero_centred_norms

    @property
    def hidden_size(self) -> int:
        return self.layer_cfg.hidden_size


def mtp_config_for(target_cfg: TargetConfig) -> MtpConfig:
    """The MTP config of a target (layer 0 takes the sparse MLP when the target's last layer is
    sparse, as `MtpModel` copies the last layer's class; always full attention)."""
    last = target_cfg.num_hidden_layers - 1
    layer_cfg = dataclasses.replace(
        target_cfg, num_hidden_layers=1, layer_types=("full_attention",),
        mlp_only_layers=() if target_cfg.is_moe_layer(last) else (0,), decoder_sparse_step=1)
    return MtpConfig(layer_cfg)


class MtpHead(nnx.Module):
    """Params: `pre_fc_norm_embedding`, `pre_fc_norm_hidden`, `fc` `[2H, H]`, `layers[0]`, `norm`."""

    def __init__(self, mcfg: MtpConfig, *, dtype, rngs: nnx.Rngs, mesh_rules=None):
        self.mcfg = mcfg
        h = mcfg.hidden_size
        norm_init = params.zeros if mcfg.zero_centred else params.ones
        self.pre_fc_norm_embedding = norm_init((h,), (None,), dtype)
        self.pre_fc_norm_hidden = norm_init((h,), (None,), dtype)
        self.fc = params.weight(rngs, (2 * h, h), ("features", "embed"), dtype)
        self.layers = nnx.List([DecoderLayer(mcfg.layer_cfg, 0, dtype, rngs, first_key_slot=1, stacked=False,
                                                 mesh_rules=mesh_rules)])
        self.norm = norm_init((h,), (None,), dtype)

    def _norm(self, x, w):
        return rms_norm(x, w[...], self.mcfg.layer_cfg.rms_norm_eps, self.mcfg.zero_centred)

    @jax.named_scope("mtp")
    def __call__(self, embeds_bth: jax.Array, hidden_bth: jax.Array, positions_bt: jax.Array,
                 cache: KVCache | None = None, kv_valid_bt: jax.Array | None = None):
        """One MTP step over rows `(hidden at t, embedding of x_{t+1})` at positions t+1.

        Returns the pre-norm output `h [B, T, H]` and the cache (slot == position; positions
        `>= max_len` are scratch: not written). Use `post_norm(h)` for logits and chaining.
        """
        x = self._fuse(embeds_bth, hidden_bth)
        cos, sin = self._rope(positions_bt, x.dtype)
        h, cache = self.layers[0](x, positions_bt, cos, sin, cache, kv_valid_bt)
        return h, cache

    def _fuse(self, embeds_bth, hidden_bth):
        return jnp.concatenate([self._norm(embeds_bth, self.pre_fc_norm_embedding),
                                self._norm(hidden_bth, self.pre_fc_norm_hidden)], axis=-1) @ self.fc[...]

    def _rope(self, positions_bt, dtype):
        cfg = self.mcfg.layer_cfg
        return rope_cos_sin(positions_bt, cfg.rotary_dim, cfg.rope_theta, dtype)

    @jax.named_scope("mtp")
    def advance(self, embeds_bth: jax.Array, hidden_bth: jax.Array, positions_bt: jax.Array, cache: KVCache,
                last_b: jax.Array) -> tuple[jax.Array, KVCache]:
        """The decode round's MTP advance: writes the keys and values of every row (positions
        `>= max_len` are scratch) and runs the rest of the layer for row `last_b` only -- the one
        whose output predicts the next first candidate; the other rows are only ever keys. Returns
        that row's pre-norm output `[B, H]` (what `__call__` gives at `last_b`) and the cache.

        Example:
            >>> h_bh, cache = head.advance(embeds_bth, hidden_bth, positions_bt, cache, accepted_b)  # doctest: +SKIP
        """
        layer = self.layers[0]
        attn = layer.self_attn
        x = self._fuse(embeds_bth, hidden_bth)
        x_norm = layer.norm(x, layer.input_layernorm)
        cos, sin = self._rope(positions_bt, x.dtype)
        cache = attn.write(cache, 0, *attn.kv(x_norm, cos, sin), positions_bt)
        pick = lambda a: jnp.take_along_axis(a, last_b.reshape((-1, 1) + (1,) * (a.ndim - 2)), axis=1)  # noqa: E731
        q, gate = attn.q_gate(pick(x_norm), pick(cos), pick(sin))
        h = layer.finish(pick(x), attn.attend_cache(q, gate, pick(positions_bt), cache, 0))
        return h[:, 0], cache

    def post_norm(self, h_bth: jax.Array) -> jax.Array:
        """`mtp.norm`: the state that feeds the LM head and the next chained step."""
        return self._norm(h_bth, self.norm)
