"""Native MTP head (Qwen3.5 / Qwen3-Next / Qwen3.6 `mtp.*` format) for a Qwen-family target: one step
predicts token t+2 from the target's post-norm hidden at t and the token at t+1,
`logits = target.logits(norm(layer(fc([RMS(embed(x_{t+1})) ; RMS(h_t)]))))`, with its own KV cache
(rows from position 1); chained steps feed the output back (docs/models-detail.md).

The MTP-head protocol the rounds call (`models/gemma4_assistant.py` is the other head): `head(embeds,
hidden, positions, cache, target_kv=...)` and `head.advance(..., target_kv=...)` (`target_kv`: the
target's cache view, for heads that read it; this one keeps its own), `post_norm`, `scores`,
`feature` (the DMTP fusion's MTP feature), `chain_position` (where chained step j sits) and
`reads_target_kv` (whether a step reads `target_kv`: training then keeps the target's K/V)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from dmtp_jax.config import TargetConfig
from dmtp_jax.layers import params
from dmtp_jax.layers.kv_cache import KVCache
from dmtp_jax.layers.norms import rms_norm
from dmtp_jax.layers.rope import rope_tables
from dmtp_jax.models.deepseek import decoder_layer_class
from dmtp_jax.models.draft_head import DraftScores, draft_scores


@dataclasses.dataclass(frozen=True)
class MtpConfig:
    """The MTP head of a target: a 1-layer, full-attention copy of the target's layer config."""
    layer_cfg: TargetConfig

    @property
    def zero_centred(self) -> bool:
        return self.layer_cfg.zero_centred_norms

    @property
    def hidden_size(self) -> int:
        return self.layer_cfg.hidden_size

    @property
    def cache_layers(self) -> int:
        """Layers of the head's private K/V cache (the decoders make it `[cache_layers, B, S, kv, D]`)."""
        return 1

    @property
    def own_head(self) -> bool:
        """Scores with the target's LM head, or a drafting head in its place (`options.check_draft_head_applies`)."""
        return False


def mtp_config_for(target_cfg: TargetConfig) -> MtpConfig:
    """The MTP config of a target (a sparse MLP when the target's last layer is sparse; full attention)."""
    last = target_cfg.num_hidden_layers - 1
    layer_cfg = dataclasses.replace(
        target_cfg, num_hidden_layers=1, layer_types=("full_attention",),
        mlp_only_layers=() if target_cfg.is_moe_layer(last) else (0,), decoder_sparse_step=1)
    return MtpConfig(layer_cfg)


class MtpHead(nnx.Module):
    """Params: `pre_fc_norm_embedding`, `pre_fc_norm_hidden`, `fc` `[2H, H]`, `layers[0]`, `norm`."""
    reads_target_kv = False

    def __init__(self, mcfg: MtpConfig, *, dtype, rngs: nnx.Rngs, mesh_rules=None):
        self.mcfg = mcfg
        h = mcfg.hidden_size
        norm_init = params.zeros if mcfg.zero_centred else params.ones
        self.pre_fc_norm_embedding = norm_init((h,), (None,), dtype)
        self.pre_fc_norm_hidden = norm_init((h,), (None,), dtype)
        self.fc = params.weight(rngs, (2 * h, h), ("features", "embed"), dtype)
        layer_cls = decoder_layer_class(mcfg.layer_cfg)
        self.layers = nnx.List([layer_cls(mcfg.layer_cfg, 0, dtype, rngs, first_key_slot=1, stacked=False,
                                          mesh_rules=mesh_rules)])
        self.norm = norm_init((h,), (None,), dtype)

    def _norm(self, x, w):
        return rms_norm(x, w[...], self.mcfg.layer_cfg.rms_norm_eps, self.mcfg.zero_centred)

    @jax.named_scope("mtp")
    def __call__(self, embeds_bth: jax.Array, hidden_bth: jax.Array, positions_bt: jax.Array,
                 cache: KVCache | None = None, kv_valid_bt: jax.Array | None = None, target_kv=None):
        """One MTP step over rows `(hidden at t, embedding of x_{t+1})` at positions t+1: the pre-norm
        output `h [B, T, H]` and the cache (slot == position; positions `>= max_len` are not written).
        `target_kv` is not read (the protocol's, module docstring)."""
        x = self._fuse(embeds_bth, hidden_bth)
        cos, sin = self._rope(positions_bt, x.dtype)
        h, cache = self.layers[0](x, positions_bt, cos, sin, cache, kv_valid_bt)
        return h, cache

    def _fuse(self, embeds_bth, hidden_bth):
        return jnp.concatenate([self._norm(embeds_bth, self.pre_fc_norm_embedding),
                                self._norm(hidden_bth, self.pre_fc_norm_hidden)], axis=-1) @ self.fc[...]

    def _rope(self, positions_bt, dtype):
        return rope_tables(self.mcfg.layer_cfg, positions_bt, dtype)

    @jax.named_scope("mtp")
    def advance(self, embeds_bth: jax.Array, hidden_bth: jax.Array, positions_bt: jax.Array, cache: KVCache,
                last_b: jax.Array, target_kv=None) -> tuple[jax.Array, KVCache]:
        """The decode round's MTP advance: writes K/V of every row (positions `>= max_len`: scratch) and runs
        the rest of the layer for row `last_b` only: `(its pre-norm output [B, H], cache)`."""
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

    def scores(self, target, head, y: jax.Array) -> DraftScores:
        """The draft scores of `y = post_norm(h)`: the target's LM head, or the drafting side's efficient
        head `head` (`draft_head.draft_scores`)."""
        return draft_scores(target, head, y)

    def feature(self, h: jax.Array) -> jax.Array:
        """The DMTP fusion's MTP feature of a state `h`: `h` itself."""
        return h

    def chain_position(self, lengths_b: jax.Array, j: int) -> jax.Array:
        """The position of chained step `j` (2: the step after T1) for rows of committed length `lengths_b`:
        one past the previous step's, `L + j - 1`."""
        return lengths_b + j - 1
