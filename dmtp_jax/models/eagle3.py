"""The EAGLE-3 drafter (the published `LlamaForCausalLMEagle3` layout) as an NNX module: one Llama
decoder layer over a row `(g_p, x_{p+1})` predicting x_{p+2}, `g_p` the fused tapped target
features (step 1) or its own previous output; logits over a draft vocabulary mapped to target ids
by `vocab_map`. Its K/V cache rolls back like the MTP head's. Equations: docs/models-detail.md.

Example:
    >>> cfg = Eagle3Config(hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1,
    ...                    head_dim=8, vocab_size=64, draft_vocab_size=32, target_layer_ids=(0, 1, 1))
    >>> drafter = Eagle3Drafter(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))
    >>> drafter.fc.shape, drafter.lm_head.shape
    ((48, 16), (16, 32))
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from dmtp_jax.errors import ConfigError
from dmtp_jax.layers import params
from dmtp_jax.layers.attention import MaskRule, grouped_attention
from dmtp_jax.layers.kv_cache import KVCache, write_layer
from dmtp_jax.layers.mlp import gated_mlp
from dmtp_jax.layers.norms import rms_norm
from dmtp_jax.layers.rope import apply_rope, rope_cos_sin
from dmtp_jax.models.dflash_config import check_hidden_and_taps

ARCHITECTURE = "LlamaForCausalLMEagle3"
DEFAULT_BLOCK_SIZE = 8      # verify slots: the pending token + 7 chained drafts


def default_layer_ids(num_target_layers: int) -> tuple[int, ...]:
    """The published default taps as layer outputs (HF `hidden_states[i + 1]`): the inputs of layers
    2, L/2 and L-3, clamped into the target's layers.

    Example:
        >>> default_layer_ids(36), default_layer_ids(2)
        ((1, 17, 32), (1, 0, 0))
    """
    n = num_target_layers
    return tuple(min(max(i - 1, 0), n - 1) for i in (2, n // 2, n - 3))


@dataclasses.dataclass(frozen=True)
class Eagle3Config:
    """An EAGLE-3 drafter's config; `vocab_size` is the target's vocabulary, `target_layer_ids` the
    tapped target layer outputs (`len * hidden_size` wide into `fc`), `block_size` the verify slots
    of a decode round (not a published field; `eagle_config.dmtp_block_size` when saved)."""
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    draft_vocab_size: int
    target_layer_ids: tuple[int, ...]
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 32768
    own_embeddings: bool = False
    block_size: int = DEFAULT_BLOCK_SIZE
    num_hidden_layers: int = 1           # one layer: the context cache's layer count
    chained: ClassVar[bool] = True       # its cache and hidden advance like the MTP's (`decode/round.py`)

    def __post_init__(self):
        where = "EAGLE-3 drafter config"
        for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                    "vocab_size", "draft_vocab_size"):
            if getattr(self, key) < 1:
                raise ConfigError(f"{where}: '{key}' must be positive, got {getattr(self, key)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(f"{where}: num_attention_heads={self.num_attention_heads} is not a multiple of "
                              f"num_key_value_heads={self.num_key_value_heads}")
        if self.draft_vocab_size > self.vocab_size:
            raise ConfigError(f"{where}: draft_vocab_size={self.draft_vocab_size} exceeds vocab_size={self.vocab_size}")
        if not self.target_layer_ids:
            raise ConfigError(f"{where}: no tapped target layers")

    @property
    def num_context_features(self) -> int:
        return len(self.target_layer_ids) * self.hidden_size

    def to_hf_dict(self) -> dict:
        """The `config.json` dict: the published fields, plus `eagle_config.dmtp_block_size`."""
        return {
            "architectures": [ARCHITECTURE], "model_type": "llama", "hidden_act": "silu",
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size, "num_hidden_layers": 1,
            "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim, "vocab_size": self.vocab_size, "draft_vocab_size": self.draft_vocab_size,
            "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta, "attention_bias": False,
            "max_position_embeddings": self.max_position_embeddings, "tie_word_embeddings": False,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(self.target_layer_ids),
                             "use_aux_hidden_state": True, "dmtp_block_size": self.block_size},
        }


def default_eagle3_config(target_cfg, block_size: int = DEFAULT_BLOCK_SIZE, intermediate_size: int | None = None,
                          layer_ids: tuple[int, ...] | None = None) -> Eagle3Config:
    """A fresh drafter for a target: its attention shapes, its intermediate size (unless given), the
    full vocabulary as the draft vocabulary, the published taps (unless given)."""
    t = target_cfg
    ids = tuple(layer_ids) if layer_ids else default_layer_ids(t.num_hidden_layers)
    return Eagle3Config(hidden_size=t.hidden_size, intermediate_size=intermediate_size or t.intermediate_size,
                        num_attention_heads=t.num_attention_heads, num_key_value_heads=t.num_key_value_heads,
                        head_dim=t.head_dim, vocab_size=t.vocab_size, draft_vocab_size=t.vocab_size,
                        target_layer_ids=ids, rms_norm_eps=t.rms_norm_eps, rope_theta=t.rope_theta,
                        max_position_embeddings=t.max_position_embeddings, block_size=block_size)


class DraftVocab(nnx.Variable):
    """The target id of every draft id (int32, not trained)."""


def _row_pick(a: jax.Array, index_b: jax.Array) -> jax.Array:
    return jnp.take_along_axis(a, index_b.reshape((-1, 1) + (1,) * (a.ndim - 2)), axis=1)


class Eagle3Drafter(nnx.Module):
    """Params (our names = the checkpoint's without `.weight`): `fc`, `midlayer.{input_layernorm,
    hidden_norm, post_attention_layernorm}`, `midlayer.self_attn.{q,k,v,o}_proj`,
    `midlayer.mlp.{gate,up,down}_proj`, `norm`, `lm_head`, optional `embed_tokens`; `vocab_map`."""
    chained = True      # its cache rows pair features with the next token (`decode/round.py:commit`)

    def __init__(self, cfg: Eagle3Config, *, dtype, rngs: nnx.Rngs):
        self.cfg = cfg
        h, nh, kv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.fc = params.weight(rngs, (cfg.num_context_features, h), ("features", "embed"), dtype)
        self.midlayer = nnx.Dict(
            input_layernorm=params.ones((h,), (None,), dtype), hidden_norm=params.ones((h,), (None,), dtype),
            post_attention_layernorm=params.ones((h,), (None,), dtype),
            self_attn=nnx.Dict(q_proj=params.weight(rngs, (2 * h, nh * hd), ("features", "heads"), dtype),
                               k_proj=params.weight(rngs, (2 * h, kv * hd), ("features", "kv_heads"), dtype),
                               v_proj=params.weight(rngs, (2 * h, kv * hd), ("features", "kv_heads"), dtype),
                               o_proj=params.weight(rngs, (nh * hd, h), ("heads", "embed"), dtype)),
            mlp=nnx.Dict(gate_proj=params.weight(rngs, (h, cfg.intermediate_size), ("embed", "mlp"), dtype),
                         up_proj=params.weight(rngs, (h, cfg.intermediate_size), ("embed", "mlp"), dtype),
                         down_proj=params.weight(rngs, (cfg.intermediate_size, h), ("mlp", "embed"), dtype)))
        self.norm = params.ones((h,), (None,), dtype)
        self.lm_head = params.weight(rngs, (h, cfg.draft_vocab_size), ("embed", "vocab"), dtype)
        self.embed_tokens = (params.weight(rngs, (cfg.vocab_size, h), ("vocab", "embed"), dtype)
                             if cfg.own_embeddings else None)
        self.vocab_map = DraftVocab(jnp.arange(cfg.draft_vocab_size, dtype=jnp.int32))

    # ---- pieces ---------------------------------------------------------------------------------
    def _rms(self, x, w):
        return rms_norm(x, w[...], self.cfg.rms_norm_eps)

    def embed(self, tokens: jax.Array, target) -> jax.Array:
        """Token embeddings: the drafter's own table, else the target's (`target.embed`)."""
        if self.embed_tokens is None:
            return target.embed(tokens)
        return jnp.take(self.embed_tokens[...], tokens, axis=0)

    def fuse(self, features_btf: jax.Array) -> jax.Array:
        """`fc` of the concatenated tapped features `[.., n*H]` -> `[.., H]` (step 1's hidden)."""
        return features_btf.astype(self.fc.dtype) @ self.fc[...]

    def _qkv(self, embeds_bth, hidden_bth, positions_bt):
        m, cfg = self.midlayer, self.cfg
        x = jnp.concatenate([self._rms(embeds_bth.astype(hidden_bth.dtype), m["input_layernorm"]),
                             self._rms(hidden_bth, m["hidden_norm"])], axis=-1)
        b, t, _ = x.shape
        cos, sin = rope_cos_sin(positions_bt, cfg.head_dim, cfg.rope_theta, x.dtype)
        a = m["self_attn"]
        q = apply_rope((x @ a["q_proj"][...]).reshape(b, t, cfg.num_attention_heads, cfg.head_dim), cos, sin)
        k = apply_rope((x @ a["k_proj"][...]).reshape(b, t, cfg.num_key_value_heads, cfg.head_dim), cos, sin)
        v = (x @ a["v_proj"][...]).reshape(b, t, cfg.num_key_value_heads, cfg.head_dim)
        return q, k, v

    def _finish(self, hidden_bth, attn_bthd):
        m = self.midlayer
        b, t = attn_bthd.shape[:2]
        h = hidden_bth + attn_bthd.reshape(b, t, -1).astype(hidden_bth.dtype) @ m["self_attn"]["o_proj"][...]
        mlp = m["mlp"]
        return h + gated_mlp(self._rms(h, m["post_attention_layernorm"]), mlp["gate_proj"][...], mlp["up_proj"][...],
                          mlp["down_proj"][...])

    # ---- decoding ---------------------------------------------------------------------------------
    def step(self, embeds_bth: jax.Array, hidden_bth: jax.Array, positions_bt: jax.Array, cache: KVCache,
             last_b: jax.Array | None = None) -> tuple[jax.Array, KVCache]:
        """Rows `(hidden g_p, embedding of x_{p+1})` at positions p: writes every row's K/V (positions
        `>= max_len` are scratch) and runs the rest of the layer for every row, or only for row
        `last_b` when given. Returns the pre-norm output (`[B, T, H]`, or `[B, H]` with `last_b`) and
        the cache."""
        q, k, v = self._qkv(embeds_bth, hidden_bth, positions_bt)
        cache = KVCache(write_layer(cache.k_lbskd, 0, k, positions_bt), write_layer(cache.v_lbskd, 0, v, positions_bt))
        if last_b is not None:
            q, hidden_bth, positions_bt = (_row_pick(a, last_b) for a in (q, hidden_bth, positions_bt))
        rule = MaskRule.over_slots(positions_bt, cache.max_len)
        attn = grouped_attention(q, cache.k_lbskd[0], cache.v_lbskd[0], rule)
        h = self._finish(hidden_bth, attn)
        return (h[:, 0], cache) if last_b is not None else (h, cache)

    def draft_logits(self, h: jax.Array) -> jax.Array:
        """fp32 logits over the draft vocabulary of pre-norm outputs."""
        return (self._rms(h, self.norm) @ self.lm_head[...]).astype(jnp.float32)

    def target_logits(self, h: jax.Array) -> jax.Array:
        """fp32 logits over the target vocabulary: the draft logits at their target ids, -inf
        elsewhere (so any sampling filter or argmax over them stays inside the draft vocabulary)."""
        draft = self.draft_logits(h)
        full = jnp.full(draft.shape[:-1] + (self.cfg.vocab_size,), -jnp.inf, jnp.float32)
        return full.at[..., self.vocab_map[...]].set(draft)

    # ---- training ---------------------------------------------------------------------------------
    def unrolled(self, embeds_bth: jax.Array, features_btf: jax.Array, valid_bt: jax.Array, steps: int):
        """Training-time test: `steps` passes over whole sequences (no cache). Pass 0 reads
        `fuse(features)`; pass k reads pass k-1's outputs shifted one position right, and its row p
        attends to pass 0's keys at positions `<= p - k` and to pass j's key at position `p - k + j`
        (j = 1..k): what chain step k of a round at committed position `p - k` sees. Returns the
        pre-norm outputs of every pass, `[steps, B, T, H]` (row p of any pass predicts x_{p+2})."""
        b, t, _ = embeds_bth.shape
        pos = jnp.broadcast_to(jnp.arange(t), (b, t))
        hidden = self.fuse(features_btf)
        keys, values, outs = [], [], []
        heads, kv = self.cfg.num_attention_heads, self.cfg.num_key_value_heads
        scale = self.cfg.head_dim ** -0.5
        idx = jnp.arange(t)
        for k in range(steps):
            q, key, val = self._qkv(embeds_bth, hidden, pos)
            keys.append(key)
            values.append(val)
            qg = q.reshape(b, t, kv, heads // kv, -1)
            base = jnp.einsum("btkgd,bskd->bkgts", qg, keys[0], preferred_element_type=jnp.float32) * scale
            allowed = (idx[None, :] <= idx[:, None] - k)[None] & valid_bt[:, None, :]
            scores = jnp.where(allowed[:, None, None], base, -jnp.inf)
            if k:       # pass j's key at position p - (k - j), j = 1..k: one stacked "diagonal" per pass
                shift = k - jnp.arange(1, k + 1)
                dk = jnp.stack([jnp.roll(keys[j], k - j, axis=1) for j in range(1, k + 1)], axis=2)
                dv = jnp.stack([jnp.roll(values[j], k - j, axis=1) for j in range(1, k + 1)], axis=2)
                diag = jnp.einsum("btkgd,btjkd->bkgtj", qg, dk, preferred_element_type=jnp.float32) * scale
                diag = jnp.where((idx[:, None] >= shift[None])[None, None, None], diag, -jnp.inf)
                scores = jnp.concatenate([scores, diag], axis=-1)
            s_max = jnp.max(scores, axis=-1, keepdims=True)
            w = jnp.exp(scores - jnp.where(jnp.isfinite(s_max), s_max, 0.0))
            w = w / jnp.maximum(jnp.sum(w, axis=-1, keepdims=True), 1e-30)
            out = jnp.einsum("bkgts,bskd->btkgd", w[..., :t].astype(values[0].dtype), values[0])
            if k:
                out = out + jnp.einsum("bkgtj,btjkd->btkgd", w[..., t:].astype(dv.dtype), dv)
            h = self._finish(hidden, out.reshape(b, t, heads, -1))
            outs.append(h)
            hidden = jnp.pad(h[:, :-1], ((0, 0), (1, 0), (0, 0)))
        return jnp.stack(outs)


def check_fits_target(cfg: Eagle3Config, target_cfg) -> None:
    """Raises `ConfigError` (one line, naming the key) when the drafter cannot run on this target."""
    where = "EAGLE-3 drafter does not fit the target"
    if cfg.vocab_size != target_cfg.vocab_size:
        raise ConfigError(f"{where}: drafter 'vocab_size'={cfg.vocab_size} but the target's "
                          f"vocab_size={target_cfg.vocab_size}")
    check_hidden_and_taps(where, cfg.hidden_size, cfg.target_layer_ids, "eagle_aux_hidden_state_layer_ids",
                          target_cfg)
