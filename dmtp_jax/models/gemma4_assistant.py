"""Gemma 4's assistant drafter (`gemma4_assistant`) as an MTP-kind head: a few Gemma 4 layers with no
K/V of their own that read the target's cache.

One step, at the position `p` of the token `x_p` whose embedding it takes (transformers'
`Gemma4AssistantCandidateGenerator` convention):

    u = pre_projection([E_target(x_p) ; h])           # the target's scaled embedding first, h [H_target]
    for each layer: the Gemma 4 block; its queries (RoPE at p) read the target's K/V of the target's
        last layer of the same type (`kv_source_layers`) at positions < p (sliding: the last window + 1,
        as transformers masks them)
    f = norm(u);  h' = post_projection(f) [H_target];  logits = head(f)
    the state carried to the next step / T1 / the DMTP fusion: [h' ; f] (`h'` is the fusion's feature)

`h` is the target's last hidden state at `p - 1` for the first step and the previous step's `h'`
after it. `head`: the tied `embed_tokens`, or with `use_ordered_embeddings` the centroid-masked
head: the `centroid_intermediate_top_k` best centroids of `f @ centroids` pick their
`vocab / num_centroids` tokens each (`token_ordering`), those get `f . E(token)` and every other
token the smallest of those minus 1. No logit soft-capping.

Example:
    >>> acfg = assistant_config_from_hf(hf_dict, target_cfg)  # doctest: +SKIP
    >>> state, _ = GemmaAssistant(acfg, dtype=jnp.float32, rngs=nnx.Rngs(0))(embeds, h, pos, target_kv=kv)  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from dmtp_jax.config import ConfigError, TargetConfig
from dmtp_jax.layers import params
from dmtp_jax.layers.kv_cache import KVCache
from dmtp_jax.layers.norms import rms_norm
from dmtp_jax.models.draft_head import DraftScores
from dmtp_jax.models.gemma4 import GemmaDecoderLayer


@dataclasses.dataclass(frozen=True)
class AssistantConfig:
    """A `gemma4_assistant`: its layers' config (Gemma 4 sizes of its own; the attention sizes of each
    layer type are the target's), the target's hidden size, the masked head's sizes (0 centroids: the
    plain tied head) and, per assistant layer, the target cache layer it reads."""
    layer_cfg: TargetConfig
    backbone_hidden_size: int
    num_centroids: int
    centroid_top_k: int
    kv_source_layers: tuple[int, ...]

    @property
    def hidden_size(self) -> int:
        """The width of the state the decode rounds carry between steps: `[h' ; f]` (`GemmaAssistant`)."""
        return self.backbone_hidden_size + self.layer_cfg.hidden_size

    @property
    def cache_layers(self) -> int:
        """No private K/V (the layers read the target's cache): the decoders' MTP cache is empty."""
        return 0

    @property
    def own_head(self) -> bool:
        """Scores with its own head (`GemmaAssistant.scores`): a drafting head (`--draft-head`) does not apply."""
        return True


def assistant_config_from_hf(d: dict, target_cfg: TargetConfig) -> AssistantConfig:
    """The assistant config of a `gemma4_assistant` `config.json` dict for `target_cfg`; one error when
    its attention sizes or vocabulary are not the target's."""
    if target_cfg.gemma is None:
        raise ConfigError(f"a gemma4_assistant drafts for Gemma 4 targets, not {target_cfg.model_type}")
    text = dict(d.get("text_config") or {}, model_type="gemma4_text", num_kv_shared_layers=0)
    cfg = TargetConfig.from_hf_dict(text)
    g, tg = cfg.gemma, target_cfg.gemma
    mine = (cfg.vocab_size, cfg.head_dim, cfg.num_key_value_heads, cfg.sliding_window, g.global_head_dim,
            g.global_kv_heads, g.k_eq_v)
    theirs = (target_cfg.vocab_size, target_cfg.head_dim, target_cfg.num_key_value_heads, target_cfg.sliding_window,
              tg.global_head_dim, tg.global_kv_heads, tg.k_eq_v)
    if mine != theirs:
        raise ConfigError(f"gemma4_assistant: (vocab, head_dim, kv heads, window, global head_dim, global kv heads, "
                          f"k_eq_v) {mine} differ from the target's {theirs}")
    if int(d.get("backbone_hidden_size", 0)) != target_cfg.hidden_size:
        raise ConfigError(f"gemma4_assistant: backbone_hidden_size {d.get('backbone_hidden_size')} is not the "
                          f"target's hidden_size {target_cfg.hidden_size}")
    last = {t: max(i for i, u in enumerate(target_cfg.layer_types) if u == t) for t in set(target_cfg.layer_types)}
    missing = set(cfg.layer_types) - set(last)
    if missing:
        raise ConfigError(f"gemma4_assistant: layer types {sorted(missing)} have no target layer to read")
    ordered = bool(d.get("use_ordered_embeddings", False))
    centroids = int(d.get("num_centroids", 2048)) if ordered else 0
    if centroids and cfg.vocab_size % centroids:
        raise ConfigError(f"gemma4_assistant: vocab {cfg.vocab_size} is not a multiple of num_centroids {centroids}")
    return AssistantConfig(cfg, target_cfg.hidden_size, centroids, int(d.get("centroid_intermediate_top_k", 32)),
                           tuple(last[t] for t in cfg.layer_types))


def masked_logits(f_bth: jax.Array, centroids_hc: jax.Array, ordering_v: jax.Array, embed_vh: jax.Array,
                  top_k: int) -> jax.Array:
    """The centroid-masked head's fp32 logits `[B, T, V]` (module docstring); the fill is per row.

    Example:
        >>> masked_logits(jnp.ones((1, 1, 2)), jnp.eye(2), jnp.array([2, 0, 1, 3]), jnp.eye(4, 2), 1).shape
        (1, 1, 4)
    """
    c = centroids_hc.shape[1]
    per = ordering_v.shape[0] // c
    _, top_btk = jax.lax.top_k(jnp.einsum("bth,hc->btc", f_bth, centroids_hc, preferred_element_type=jnp.float32),
                               top_k)
    tokens = ordering_v.reshape(c, per)[top_btk].reshape(top_btk.shape[:2] + (top_k * per,))
    picked = jnp.einsum("bth,btnh->btn", f_bth, embed_vh[tokens], preferred_element_type=jnp.float32)
    fill = jnp.min(picked, axis=-1, keepdims=True) - 1.0
    out = jnp.broadcast_to(fill, f_bth.shape[:2] + (ordering_v.shape[0],))
    rows_b = jnp.arange(f_bth.shape[0])[:, None, None]
    rows_t = jnp.arange(f_bth.shape[1])[None, :, None]
    return out.at[rows_b, rows_t, tokens].set(picked)


class GemmaAssistant(nnx.Module):
    """Params: `embed_tokens [V, Ha]`, `pre_projection [2H, Ha]`, `post_projection [Ha, H]`, `layers`,
    `norm`, and with the masked head `centroids [Ha, C]` and `token_ordering [V]` (int32)."""
    reads_target_kv = True

    def __init__(self, acfg: AssistantConfig, *, dtype, rngs: nnx.Rngs, mesh_rules=None):
        self.acfg = acfg
        cfg, h, ha = acfg.layer_cfg, acfg.backbone_hidden_size, acfg.layer_cfg.hidden_size
        self.embed_tokens = params.weight(rngs, (cfg.vocab_size, ha), ("vocab", "embed"), dtype)
        self.pre_projection = params.weight(rngs, (2 * h, ha), ("features", "embed"), dtype)
        self.post_projection = params.weight(rngs, (ha, h), ("embed", None), dtype)
        self.layers = nnx.List([GemmaDecoderLayer(cfg, i, dtype, rngs, kv_shared=True, stacked=False)
                                for i in range(cfg.num_hidden_layers)])
        self.norm = params.ones((ha,), (None,), dtype)
        if acfg.num_centroids:
            self.centroids = params.weight(rngs, (ha, acfg.num_centroids), ("embed", None), dtype)
            self.token_ordering = nnx.Param(jnp.arange(cfg.vocab_size, dtype=jnp.int32), logical_axes=(None,))

    def features(self, embeds_bth, hidden_bth, positions_bt, target_kv: KVCache) -> jax.Array:
        """The final normed state `f [B, T, Ha]` of rows `(E(x_p), h)` at positions `p`, each reading the
        target's cached K/V at positions `< p`."""
        x = jnp.concatenate([embeds_bth, hidden_bth.astype(embeds_bth.dtype)], axis=-1) @ self.pre_projection[...]
        for layer, source in zip(self.layers, self.acfg.kv_source_layers):
            attn = layer.self_attn
            cos, sin = attn.cos_sin(positions_bt, x.dtype)
            q, _ = attn.q_gate(layer.norm(x, layer.input_layernorm), cos, sin)
            y = attn.attend_cache(q, None, positions_bt, target_kv, source, key_limit_bt=positions_bt - 1)
            x = layer.finish(x, y)
        return rms_norm(x, self.norm[...], self.acfg.layer_cfg.rms_norm_eps)

    def projected(self, f_bth: jax.Array) -> jax.Array:
        """`h' = post_projection(f)`: the next step's hidden input."""
        return f_bth @ self.post_projection[...]

    def logits(self, f_bth: jax.Array) -> jax.Array:
        """fp32 logits `[..., V]` of `f [..., Ha]`: the tied head, or the centroid-masked one."""
        if not self.acfg.num_centroids:
            return jnp.einsum("...h,vh->...v", f_bth, self.embed_tokens[...], preferred_element_type=jnp.float32)
        flat = f_bth.reshape(-1, 1, f_bth.shape[-1])
        out = masked_logits(flat, self.centroids[...], self.token_ordering[...], self.embed_tokens[...],
                            self.acfg.centroid_top_k)
        return out.reshape(f_bth.shape[:-1] + out.shape[-1:])

    # ---- the MTP-head protocol (`models/mtp.py`): the carried state is `[h' ; f]` -----------------
    @jax.named_scope("assistant")
    def __call__(self, embeds_bth, hidden_bth, positions_bt, cache=None, kv_valid_bt=None, *, target_kv: KVCache):
        """One step over rows `(E(x_p), hidden)` at positions `p`: `([h' ; f] [B, T, H + Ha], cache)`.
        `hidden` is the target's `[B, T, H]` or a previous state `[h' ; f]` (its `h'` is read); `cache`
        (the protocol's private cache) is passed through untouched."""
        h = self.acfg.backbone_hidden_size
        f = self.features(embeds_bth, hidden_bth[..., :h], positions_bt, target_kv)
        return jnp.concatenate([self.projected(f), f], axis=-1), cache

    def advance(self, embeds_bth, hidden_bth, positions_bt, cache, last_b, target_kv: KVCache):
        """The step of row `last_b` only: `(its state [B, H + Ha], cache)`."""
        pick = lambda a: jnp.take_along_axis(a, last_b.reshape((-1, 1) + (1,) * (a.ndim - 2)), axis=1)  # noqa: E731
        state, cache = self(pick(embeds_bth), pick(hidden_bth), pick(positions_bt), cache, target_kv=target_kv)
        return state[:, 0], cache

    def post_norm(self, state):
        """The state itself (the step already normed `f`)."""
        return state

    def scores(self, target, head, state) -> DraftScores:
        """The assistant's own head over `f` (the drafting side's `head` is not used)."""
        logits = self.logits(state[..., self.acfg.backbone_hidden_size:])
        return DraftScores(logits, jnp.full(logits.shape[:-1], -jnp.inf, jnp.float32))

    def feature(self, state):
        """`h'`, the DMTP fusion's MTP feature (the target's hidden size)."""
        return state[..., :self.acfg.backbone_hidden_size]

    def chain_position(self, lengths_b, j: int):
        """Every chained step stays at the pending token's position `L` over the committed K/V, as
        transformers' candidate generator runs it."""
        return lengths_b
