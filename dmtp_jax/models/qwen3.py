"""The Qwen target family as NNX modules, run as pure functions: Qwen3 dense and MoE, and the hybrid
Qwen3.5 / Qwen3.6 (`qwen3_5`, `qwen3_5_moe`) and Qwen3-Next targets.

One forward serves prefill, decode, verify and training: new tokens at explicit per-row positions,
with a `TargetCache` or none; it returns the post-final-norm hidden state and, on request, chosen
layers' outputs. The cache protocol (forward, `speculative=True`, `commit`) is docs/ARCHITECTURE.md's.

Example:
    >>> from dmtp_jax.config import TargetConfig
    >>> cfg = TargetConfig.from_hf_dict({"model_type": "qwen3", "vocab_size": 64, "hidden_size": 16,
    ...     "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
    ...     "num_key_value_heads": 1, "head_dim": 8})
    >>> model = QwenTarget(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))
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
from dmtp_jax.layers.attention import DENSE_MAX_QUERIES, MaskRule, grouped_attention
from dmtp_jax.layers.kv_cache import KVCache, PendingBlock, TargetCache, write_layer
from dmtp_jax.layers.mlp import gated_mlp
from dmtp_jax.layers.moe import moe_mlp
from dmtp_jax.layers.norms import rms_norm
from dmtp_jax.layers.rope import apply_rope, rope_tables
from dmtp_jax.models.deltanet import GatedDeltaNet, commit_states
from dmtp_jax.models.layer_stack import Context, captured_outputs, plan_stacks, run_stacks, stacked
from dmtp_jax.sharding import MeshRules


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TargetOutput:
    hidden_bth: jax.Array                 # post-final-norm hidden (MTP input, LM head input)
    captured: tuple[jax.Array, ...]       # outputs of the requested layers, [B, T, H] each
    cache: TargetCache | None
    pending: PendingBlock | None = None   # a speculative call's DeltaNet block inputs (for commit)


class Attention(nnx.Module):
    """GQA attention with per-head q/k RMSNorm and RoPE. Hybrid families add the sigmoid output
    gate (`q_proj` is `[H, heads * 2D]`, each head's query then its gate), zero-centred q/k norms
    and partial rotary (the tables' width). Also the drafter's attention (`models/dflash.py`)."""

    def __init__(self, cfg, layer: int, dtype, rngs: nnx.Rngs, *, first_key_slot: int = 0):
        h, nh, kv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.first_key_slot = first_key_slot      # cache slots below it are never keys (the MTP's 0)
        self.num_heads, self.num_kv_heads, self.head_dim = nh, kv, hd
        self.eps = cfg.rms_norm_eps
        self.gated = bool(getattr(cfg, "attn_output_gate", False))
        self.zero_centred = bool(getattr(cfg, "zero_centred_norms", False))
        self.window = cfg.sliding_window if cfg.layer_types[layer] == "sliding_attention" else None
        self.q_proj = params.weight(rngs, (h, nh * hd * (2 if self.gated else 1)), ("embed", "heads"), dtype)
        self.k_proj = params.weight(rngs, (h, kv * hd), ("embed", "kv_heads"), dtype)
        self.v_proj = params.weight(rngs, (h, kv * hd), ("embed", "kv_heads"), dtype)
        self.o_proj = params.weight(rngs, (nh * hd, h), ("heads", "embed"), dtype)
        self.has_bias = cfg.attention_bias
        if cfg.attention_bias:
            self.q_bias = params.zeros((nh * hd,), ("heads",), dtype)
            self.k_bias = params.zeros((kv * hd,), ("kv_heads",), dtype)
            self.v_bias = params.zeros((kv * hd,), ("kv_heads",), dtype)
            self.o_bias = params.zeros((h,), (None,), dtype)
        norm_init = params.zeros if self.zero_centred else params.ones
        self.q_norm = norm_init((hd,), (None,), dtype)
        self.k_norm = norm_init((hd,), (None,), dtype)

    def q_gate(self, x_bth, cos, sin):
        """Projected, per-head normed and rotated q `[B,T,nh,D]` and the output gate `[B,T,nh*D]`
        (None without one)."""
        b, t, _ = x_bth.shape
        q = x_bth @ self.q_proj[...]
        if t <= DENSE_MAX_QUERIES:
            # A few rows (decode, verify and drafter blocks): left free, XLA's TPU layout pass copies
            # `q_proj` transposed per layer and call to emit heads-major rows; the barrier keeps q row-major.
            q = jax.lax.optimization_barrier(q)
        if self.has_bias:
            q = q + self.q_bias[...]
        gate = None
        if self.gated:
            q = q.reshape(b, t, self.num_heads, 2 * self.head_dim)
            q, gate = q[..., :self.head_dim], q[..., self.head_dim:].reshape(b, t, -1)
        q = rms_norm(q.reshape(b, t, self.num_heads, self.head_dim), self.q_norm[...], self.eps, self.zero_centred)
        return apply_rope(q, cos, sin), gate

    def kv(self, x_bth, cos, sin):
        """Projected k (per-head normed, rotated) and v, both `[B,T,kv,D]`."""
        b, t, _ = x_bth.shape
        k, v = x_bth @ self.k_proj[...], x_bth @ self.v_proj[...]
        if self.has_bias:
            k, v = k + self.k_bias[...], v + self.v_bias[...]
        k = rms_norm(k.reshape(b, t, self.num_kv_heads, self.head_dim), self.k_norm[...], self.eps,
                     self.zero_centred)
        return apply_rope(k, cos, sin), v.reshape(b, t, self.num_kv_heads, self.head_dim)

    def qkv(self, x_bth, cos, sin):
        """q, k and v (`q_gate` without the gate, and `kv`)."""
        return (self.q_gate(x_bth, cos, sin)[0], *self.kv(x_bth, cos, sin))

    def out(self, attn_bthd, gate_btf=None):
        b, t = attn_bthd.shape[:2]
        y = attn_bthd.reshape(b, t, -1)
        if gate_btf is not None:
            y = y * jax.nn.sigmoid(gate_btf)
        y = y @ self.o_proj[...]
        return y + self.o_bias[...] if self.has_bias else y

    def write(self, cache: KVCache, kv_index, k_btkd, v_btkd, positions_bt) -> KVCache:
        """The cache with this layer's new keys and values (cache layer `kv_index`, a Python int or
        a traced scalar) at their positions (slot == position)."""
        return KVCache(write_layer(cache.k_lbskd, kv_index, k_btkd, positions_bt),
                       write_layer(cache.v_lbskd, kv_index, v_btkd, positions_bt))

    def attend_cache(self, q_bthd, gate_btf, positions_bt, cache: KVCache, kv_index):
        """Output of queries at `positions_bt` over cache layer `kv_index`'s keys (causal, window,
        never a slot below `first_key_slot`)."""
        keys, values = cache.k_lbskd[kv_index], cache.v_lbskd[kv_index]
        rule = MaskRule.over_slots(positions_bt, cache.max_len, self.first_key_slot, self.window)
        return self.out(grouped_attention(q_bthd, keys, values, rule), gate_btf)

    def __call__(self, x_bth, positions_bt, cos, sin, cache: KVCache | None, kv_valid_bt, kv_index=0):
        """Attention of the new tokens: over each other without a cache, else written to and read
        from cache layer `kv_index`."""
        q, gate = self.q_gate(x_bth, cos, sin)
        k, v = self.kv(x_bth, cos, sin)
        if cache is None:
            rule = MaskRule(positions_bt, positions_bt, kv_valid_bt, causal=True, window=self.window,
                            self_keys=True)
            return self.out(grouped_attention(q, k, v, rule), gate), cache
        cache = self.write(cache, kv_index, k, v, positions_bt)
        return self.attend_cache(q, gate, positions_bt, cache, kv_index), cache


class DenseMLP(nnx.Module):
    """`layers/mlp.py:gated_mlp` over this layer's kernels; `act`: the gate's activation (SwiGLU: silu)."""

    def __init__(self, h: int, inter: int, dtype, rngs: nnx.Rngs, act=jax.nn.silu):
        self.act = act
        self.gate_proj = params.weight(rngs, (h, inter), ("embed", "mlp"), dtype)
        self.up_proj = params.weight(rngs, (h, inter), ("embed", "mlp"), dtype)
        self.down_proj = params.weight(rngs, (inter, h), ("mlp", "embed"), dtype)

    def __call__(self, x):
        return gated_mlp(x, self.gate_proj[...], self.up_proj[...], self.down_proj[...], self.act)


class SparseMoE(nnx.Module):
    """Top-k routed experts; Qwen3.5-MoE / Qwen3-Next add a shared expert scaled by
    `sigmoid(x @ shared_expert_gate)`. `stacked`: the layer is one of a scanned stack (the target's);
    False for a layer of its own (the MTP's), whose experts `moe_mlp` may slice in place.
    `mesh_rules`: the rules the params are placed with (static; needed on a mesh)."""

    def __init__(self, cfg: TargetConfig, dtype, rngs: nnx.Rngs, stacked: bool = True,
                 mesh_rules: MeshRules | None = None):
        self.stacked, self.mesh_rules = stacked, mesh_rules
        h, e, i = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
        self.top_k, self.norm_topk_prob = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.router = params.weight(rngs, (h, e), ("embed", None), dtype)
        self.gate_proj = params.weight(rngs, (e, h, i), ("experts", "embed", "mlp"), dtype)
        self.up_proj = params.weight(rngs, (e, h, i), ("experts", "embed", "mlp"), dtype)
        self.down_proj = params.weight(rngs, (e, i, h), ("experts", "mlp", "embed"), dtype)
        self.has_shared = cfg.shared_expert
        if cfg.shared_expert:
            self.shared_expert = DenseMLP(h, cfg.shared_expert_intermediate_size, dtype, rngs)
            self.shared_expert_gate = params.weight(rngs, (h, 1), ("embed", None), dtype)

    def __call__(self, x_bth):
        b, t, h = x_bth.shape
        x = x_bth.reshape(b * t, h)
        y = moe_mlp(x, self.router[...], self.gate_proj[...], self.up_proj[...], self.down_proj[...],
                    self.top_k, self.norm_topk_prob, stacked=self.stacked, rules=self.mesh_rules)
        if self.has_shared:
            y = y + jax.nn.sigmoid(x @ self.shared_expert_gate[...]) * self.shared_expert(x)
        return y.reshape(b, t, h)


class DecoderLayer(nnx.Module):
    """Pre-norm block: `x += mixer(norm(x)); x += mlp(norm(x))`. The mixer is attention (`self_attn`)
    or, for `linear_attention` layers, Gated DeltaNet (`linear_attn`)."""

    def __init__(self, cfg: TargetConfig, layer: int, dtype, rngs: nnx.Rngs, *, first_key_slot: int = 0,
                 stacked: bool = True, mesh_rules: MeshRules | None = None):
        self.eps = cfg.rms_norm_eps
        self.zero_centred = cfg.zero_centred_norms
        self.is_linear = cfg.layer_types[layer] == "linear_attention"
        norm_init = params.zeros if cfg.zero_centred_norms else params.ones
        self.input_layernorm = norm_init((cfg.hidden_size,), (None,), dtype)
        self.post_attention_layernorm = norm_init((cfg.hidden_size,), (None,), dtype)
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(cfg, dtype, rngs)
        else:
            self.self_attn = Attention(cfg, layer, dtype, rngs, first_key_slot=first_key_slot)
        self.mlp = (SparseMoE(cfg, dtype, rngs, stacked, mesh_rules) if cfg.is_moe_layer(layer)
                    else DenseMLP(cfg.hidden_size, cfg.intermediate_size, dtype, rngs))

    def norm(self, x, weight):
        return rms_norm(x, weight[...], self.eps, self.zero_centred)

    def finish(self, x, mixed):
        """Residual add of the mixer output, then the MLP half of the block."""
        x = x + mixed
        with jax.named_scope("mlp"):
            return x + self.mlp(self.norm(x, self.post_attention_layernorm))

    def __call__(self, x, positions_bt, cos, sin, cache: KVCache | None, kv_valid_bt, kv_index=0):
        """An attention layer on cache layer `kv_index` (`layer_stack.run_layer` runs a DeltaNet
        layer's `linear_attn` itself, since it threads the layer's conv window and state, then calls
        `finish`)."""
        with jax.named_scope("attention"):
            attn, cache = self.self_attn(self.norm(x, self.input_layernorm), positions_bt, cos, sin, cache,
                                         kv_valid_bt, kv_index)
        return self.finish(x, attn), cache


def lm_head_logits(hidden: jax.Array, weight: jax.Array, *, tied: bool) -> jax.Array:
    """`hidden [..., H]` times the LM head, accumulated and returned in fp32 `[..., V]` whatever
    the dtype of the inputs (a bf16 product rounded to bf16 makes near-ties between logits; the
    matmul's inputs stay in their dtype, only the accumulation / output is fp32). `weight` is
    `embed_tokens [V, H]` when `tied`, else `lm_head [H, V]`. fp32 inputs: the plain product.

    Example:
        >>> w = jnp.ones((4, 3), jnp.bfloat16)
        >>> lm_head_logits(jnp.ones((2, 4), jnp.bfloat16), w, tied=False).dtype
        dtype('float32')
    """
    spec = "...h,vh->...v" if tied else "...h,hv->...v"
    return jnp.einsum(spec, hidden, weight, preferred_element_type=jnp.float32)


class QwenTarget(nnx.Module):
    """A Qwen-family causal LM. Params use `[in, out]` kernels; HF names map in `checkpoint.hf`.
    The decoder layers are scanned stacks of a repeating group (`models/layer_stack.py`; params
    `stacks.{s}.{j}.*` stacked `[groups, ...]`); `scan_layers=False` makes one unrolled stack.
    `mesh_rules`: the rules its params are placed with (the MoE layers' expert parallelism).
    `decoder_layer`: the layer class (`models/deepseek.py` subclasses this target with its MLA layer)."""
    decoder_layer = DecoderLayer

    def __init__(self, cfg: TargetConfig, *, dtype, rngs: nnx.Rngs, scan_layers: bool = True,
                 mesh_rules: MeshRules | None = None):
        self.cfg = cfg
        self.embed_tokens = params.weight(rngs, (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), dtype)
        # the layers as stacks of repeated groups, params `[repeats, ...]` (`models/layer_stack.py`)
        self.stack_specs = plan_stacks(cfg, scan_layers)

        def group(spec):
            return lambda r: nnx.List([self.decoder_layer(cfg, i, dtype, r, mesh_rules=mesh_rules)
                                       for i in range(spec.start, spec.start + spec.period)])
        self.stacks = nnx.List([stacked(group(spec), spec.repeats, rngs) for spec in self.stack_specs])
        norm_init = params.zeros if cfg.zero_centred_norms else params.ones
        self.norm = norm_init((cfg.hidden_size,), (None,), dtype)
        if not cfg.tie_word_embeddings:
            self.lm_head = params.weight(rngs, (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"), dtype)

    def layer(self, i: int) -> DecoderLayer:
        """Layer `i` as its own `DecoderLayer` (a view of its slice of the stacked params, for
        inspection and per-layer checks; the forward never builds it). An attention layer's cache
        layer is `cfg.attention_layers.index(i)`."""
        for spec, members in zip(self.stack_specs, self.stacks):
            if spec.start <= i < spec.start + spec.period * spec.repeats:
                g, j = divmod(i - spec.start, spec.period)
                graphdef, state = nnx.split(members[j])
                return nnx.merge(graphdef, jax.tree.map(lambda v: v[g], state))
        raise IndexError(f"layer {i} of a {self.cfg.num_hidden_layers}-layer target")

    @property
    def dtype(self):
        return self.embed_tokens[...].dtype

    def embed(self, tokens_bt: jax.Array) -> jax.Array:
        """Raw embedding rows (no scaling), shared with MTP and DFlash."""
        return jnp.take(self.embed_tokens[...], tokens_bt, axis=0)

    def head_weight(self) -> jax.Array:
        """The LM head's weight: `embed_tokens [V, H]` when tied, else `lm_head [H, V]`."""
        return self.embed_tokens[...] if self.cfg.tie_word_embeddings else self.lm_head[...]

    def logits(self, hidden: jax.Array) -> jax.Array:
        """fp32 logits `[..., V]` of post-norm hidden states `[..., H]` (`lm_head_logits`): the
        one LM head of the target, its MTP head and the DFlash / DMTP drafters."""
        with jax.named_scope("lm_head"):
            return lm_head_logits(hidden, self.head_weight(), tied=self.cfg.tie_word_embeddings)

    def commit(self, cache: TargetCache, pending: PendingBlock | None, keep_b: jax.Array) -> TargetCache:
        """The cache after keeping the first `keep_b` tokens of the last speculative call per row
        (`keep_b = 0`: as before that call). Attention K/V need nothing: rows past a row's length
        are never read."""
        if pending is None:
            return cache
        conv, ssm = commit_states(cache.conv_lbwc, cache.ssm_lbhkv, pending, keep_b.astype(jnp.int32))
        return TargetCache(cache.kv, conv, ssm)

    def __call__(self, tokens_bt: jax.Array, positions_bt: jax.Array, cache: TargetCache | None = None,
                 *, capture_layers: tuple[int, ...] = (), kv_valid_bt: jax.Array | None = None,
                 embeds_bth: jax.Array | None = None, speculative: bool = False) -> TargetOutput:
        """Runs new tokens at `positions [B, T]`.

        With `cache`, K/V are written at slot == position and every key `<=` the query position is
        read; without, the tokens attend causally to each other. `kv_valid_bt` marks real tokens (a
        right-padded prefix per row): padding is no key without a cache and never enters a DeltaNet
        state. `speculative=True` leaves DeltaNet states for `commit`. `embeds_bth` replaces the
        embedding lookup when given.
        """
        with jax.named_scope("embed"):
            x = self.embed(tokens_bt) if embeds_bth is None else embeds_bth
            cos, sin = rope_tables(self.cfg, positions_bt, x.dtype)
        ctx = Context(positions_bt, cos, sin, kv_valid_bt, speculative and cache is not None)
        carry, pending = run_stacks(self.stack_specs, self.stacks, x, None if cache is None else cache.kv,
                                    None if cache is None else cache.conv_lbwc,
                                    None if cache is None else cache.ssm_lbhkv, ctx, capture_layers)
        with jax.named_scope("final_norm"):
            hidden = rms_norm(carry.x_bth, self.norm[...], self.cfg.rms_norm_eps, self.cfg.zero_centred_norms)
        captured = captured_outputs(carry, capture_layers, self.cfg.num_hidden_layers - 1, hidden)
        new_cache = None if cache is None else TargetCache(carry.kv, carry.conv_lbwc, carry.ssm_lbhkv)
        return TargetOutput(hidden, captured, new_cache, pending)
