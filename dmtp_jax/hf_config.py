"""One parser of the fields every Qwen3-style stack shares (targets' `config.TargetConfig`, DFlash
drafters' `DFlashConfig`): sizes, head dims, RMSNorm eps, RoPE and per-layer attention types. A
key left out takes the value transformers 5.x's config class of that family gives it (the
per-family defaults: docs/models-detail.md).

Example:
    >>> f = stack_fields({"num_hidden_layers": 30, "num_attention_heads": 4, "hidden_size": 32,
    ...                   "use_sliding_window": True, "sliding_window": 64}, "qwen3", "config (qwen3)")
    >>> f["head_dim"], f["sliding_window"], f["layer_types"][27:]
    (128, 64, ('full_attention', 'sliding_attention', 'sliding_attention'))
"""

from __future__ import annotations

import dataclasses
from typing import Any

from dmtp_jax.errors import ConfigError

HYBRID_FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")
MLA_FAMILIES = ("deepseek_v3", "glm4_moe_lite")      # MLA attention + DeepSeek MoE (`mla_fields`)
GEMMA_FAMILIES = ("gemma4",)                          # Gemma 4 text (`gemma_fields`)
FAMILIES = ("qwen3", "qwen3_moe") + HYBRID_FAMILIES + MLA_FAMILIES + GEMMA_FAMILIES
DEFAULT_SLIDING_WINDOW = 4096      # Qwen3Config / Qwen3MoeConfig
GEMMA_SLIDING_WINDOW, GEMMA_PATTERN = 512, 6     # Gemma4TextConfig: 5 sliding layers, then 1 full
DEFAULT_MAX_WINDOW_LAYERS = 28     # Qwen3Config
DEFAULT_FULL_ATTENTION_INTERVAL = 4
HYBRID_ROTARY_FACTOR = 0.25


def require(d: dict, key: str, where: str):
    """`d[key]`, or a `ConfigError` naming the missing key."""
    if key not in d or d[key] is None:
        raise ConfigError(f"{where}: missing required key '{key}'")
    return d[key]


def rope(d: dict, where: str, family: str = "qwen3") -> tuple[float, float]:
    """`(rope_theta, partial_rotary_factor)` from `rope_parameters` (transformers >= 5), the v4
    `rope_scaling` or top-level keys; Qwen3.5's `mrope_section` is plain 1-D RoPE for text.

    Example:
        >>> rope({"rope_parameters": {"rope_theta": 1e6, "rope_type": "default"}}, "x", "qwen3_5")
        (1000000.0, 0.25)
    """
    params = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if family in GEMMA_FAMILIES:        # per layer type; the stack's own are the sliding layers'
        params = params.get("sliding_attention") or {"rope_theta": 10000.0}
    rope_type = params.get("rope_type", params.get("type", "default"))
    allowed = ("default", "yarn") if family in MLA_FAMILIES else ("default",)
    if rope_type not in allowed + (None,):
        raise ConfigError(f"{where}: rope_type '{rope_type}' is not supported (only "
                          f"{' or '.join(repr(a) for a in allowed)})")
    theta = params.get("rope_theta", d.get("rope_theta", 10000.0))
    default_factor = HYBRID_ROTARY_FACTOR if family in HYBRID_FAMILIES else 1.0
    factor = params.get("partial_rotary_factor", d.get("partial_rotary_factor", default_factor))
    return float(theta), float(factor)


def sliding_window(d: dict) -> int | None:
    """The attention window: `sliding_window` (4096 when absent) if `use_sliding_window`, else None."""
    if not d.get("use_sliding_window", False):
        return None
    window = d.get("sliding_window", DEFAULT_SLIDING_WINDOW)
    return int(window) if window is not None else None


def layer_types(d: dict, family: str, n_layers: int, window: int | None) -> tuple[str, ...]:
    """Each layer's attention type: the config's `layer_types` when given, else the family's rule.

    Example:
        >>> layer_types({}, "qwen3_next", 4, None)
        ('linear_attention', 'linear_attention', 'linear_attention', 'full_attention')
    """
    if family == "qwen3_moe":
        rule = ("sliding_attention" if window is not None else "full_attention",) * n_layers
        given = tuple(d.get("layer_types") or rule)
        if given != rule:
            raise ConfigError(f"config (qwen3_moe): layer_types {list(given)} disagree with transformers' "
                              f"Qwen3-MoE, whose sliding window (use_sliding_window) covers every layer or none")
        return rule
    if family in GEMMA_FAMILIES:        # transformers forces the last layer to full attention
        given = list(d.get("layer_types") or ("full_attention" if (i + 1) % GEMMA_PATTERN == 0
                                               else "sliding_attention" for i in range(n_layers)))
        return tuple(given[:-1] + ["full_attention"])
    if d.get("layer_types"):
        return tuple(d["layer_types"])
    if family in HYBRID_FAMILIES:
        interval = int(d.get("full_attention_interval", DEFAULT_FULL_ATTENTION_INTERVAL))
        return tuple("full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n_layers))
    first_sliding = d.get("max_window_layers", DEFAULT_MAX_WINDOW_LAYERS)
    return tuple("sliding_attention" if window is not None and i >= first_sliding else "full_attention"
                 for i in range(n_layers))


def default_head_dim(family: str, hidden: int, n_heads: int) -> int:
    """`head_dim` when the config leaves it out (module table)."""
    if family == "qwen3_moe":
        return hidden // n_heads
    if family in MLA_FAMILIES:
        return 192       # DeepSeek-V3's qk_nope_head_dim + qk_rope_head_dim (`mla_fields` sets the real one)
    return 256 if family in HYBRID_FAMILIES + GEMMA_FAMILIES else 128


def stack_fields(d: dict[str, Any], family: str, where: str) -> dict[str, Any]:
    """The shared stack fields of a config dict by the family's rules (the names `TargetConfig` and
    `DFlashConfig` share: sizes, heads, `head_dim`, eps, RoPE, `attention_bias`, `layer_types`,
    `sliding_window`).

    Example:
        >>> f = stack_fields({"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 32,
        ...                   "head_dim": 8}, "qwen3", "drafter config")
        >>> f["num_key_value_heads"], f["layer_types"], f["sliding_window"]
        (4, ('full_attention', 'full_attention'), None)
    """
    if family not in FAMILIES:
        raise ConfigError(f"unknown model_type '{family}'; supported: {', '.join(FAMILIES)}")
    n_layers = int(require(d, "num_hidden_layers", where))
    n_heads = int(require(d, "num_attention_heads", where))
    hidden = int(require(d, "hidden_size", where))
    window = sliding_window(d) if family in ("qwen3", "qwen3_moe") else None
    if family in GEMMA_FAMILIES:
        window = int(d.get("sliding_window") or GEMMA_SLIDING_WINDOW)
    theta, factor = rope(d, where, family)
    return dict(
        hidden_size=hidden, num_hidden_layers=n_layers, num_attention_heads=n_heads,
        num_key_value_heads=int(d.get("num_key_value_heads") or n_heads),
        head_dim=int(d.get("head_dim") or default_head_dim(family, hidden, n_heads)),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        rope_theta=theta, partial_rotary_factor=factor,
        attention_bias=bool(d.get("attention_bias", False)),
        layer_types=layer_types(d, family, n_layers, window),
        sliding_window=window,
    )


YARN_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
             "attention_factor", "truncate")


def mla_fields(d: dict[str, Any], where: str) -> dict[str, Any]:
    """The DeepSeek-V3 / GLM-4.7-Flash (`glm4_moe_lite`) fields (transformers' config defaults where
    a key is absent): MLA sizes (`q_lora_rank` 0 = a plain `q_proj`), the query / key head dim
    `qk_nope_head_dim + qk_rope_head_dim` as `head_dim` (rotary on its last `qk_rope_head_dim`),
    one K/V "head" per query head, DeepSeek MoE routing, which layers are dense, the yarn RoPE
    parameters and the next-token layers (`num_nextn_predict_layers`).

    Example:
        >>> f = mla_fields({"num_hidden_layers": 3, "first_k_dense_replace": 1, "q_lora_rank": None,
        ...                 "num_attention_heads": 4}, "x")
        >>> f["q_lora_rank"], f["head_dim"], f["mlp_only_layers"]
        (0, 192, (0,))
    """
    n_layers = int(require(d, "num_hidden_layers", where))
    nope, rope_dim = int(d.get("qk_nope_head_dim", 128)), int(d.get("qk_rope_head_dim", 64))
    if d.get("mlp_layer_types"):
        dense = tuple(i for i, t in enumerate(d["mlp_layer_types"]) if t != "sparse")
    else:
        first = d.get("first_k_dense_replace")
        first = (1 if d.get("model_type") == "glm4_moe_lite" else 3) if first is None else int(first)
        dense = tuple(range(min(first, n_layers)))
    params = d.get("rope_parameters") or d.get("rope_scaling") or {}
    yarn = params.get("rope_type", params.get("type")) == "yarn"
    scaling = tuple((k, params[k]) for k in YARN_KEYS if yarn and params.get(k) is not None)
    if yarn and "original_max_position_embeddings" not in dict(scaling):
        scaling += (("original_max_position_embeddings", int(d.get("max_position_embeddings", 4096))),)
    n_heads = int(require(d, "num_attention_heads", where))
    return dict(
        q_lora_rank=int(d.get("q_lora_rank") or 0), kv_lora_rank=int(d.get("kv_lora_rank", 512)),
        qk_nope_head_dim=nope, qk_rope_head_dim=rope_dim, v_head_dim=int(d.get("v_head_dim") or 128),
        head_dim=nope + rope_dim, num_key_value_heads=n_heads,
        partial_rotary_factor=rope_dim / (nope + rope_dim), rope_interleave=bool(d.get("rope_interleave", True)),
        rope_scaling=scaling,
        num_experts=int(d.get("n_routed_experts") or d.get("num_local_experts") or 0),
        num_experts_per_tok=int(d.get("num_experts_per_tok") or 0),
        moe_intermediate_size=int(d.get("moe_intermediate_size") or 0),
        shared_expert_intermediate_size=int(d.get("moe_intermediate_size") or 0) * int(d.get("n_shared_experts") or 0),
        norm_topk_prob=bool(d.get("norm_topk_prob", True)),
        n_group=int(d.get("n_group") or 1), topk_group=int(d.get("topk_group") or 1),
        routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0)),
        mlp_only_layers=dense,
        mtp_num_hidden_layers=int(d.get("num_nextn_predict_layers", d.get("num_mtp_layers", 0)) or 0),
    )


@dataclasses.dataclass(frozen=True)
class GemmaFields:
    """What a Gemma 4 text config adds to the stack fields (those are its sliding layers'): the full
    layers' own head dim and K/V heads (`global_head_dim`, `num_global_key_value_heads` when
    `attention_k_eq_v`: keys double as values there), their RoPE (`proportional`: the first
    `global_rotary_factor` of the frequencies over the whole head dim, the rest zero) and the final
    logit soft-cap (0: none)."""
    global_head_dim: int
    global_kv_heads: int
    k_eq_v: bool
    global_rope_theta: float
    global_rotary_factor: float
    final_logit_softcapping: float


# Gemma 4 features a 31B-class dense text model does not use, refused at config read.
GEMMA_REFUSED = (("hidden_size_per_layer_input", "per-layer input embeddings"),
                 ("num_kv_shared_layers", "K/V-shared target layers"), ("enable_moe_block", "the MoE block"),
                 ("use_double_wide_mlp", "the double-wide MLP"))


def gemma_fields(d: dict[str, Any], where: str) -> dict[str, Any]:
    """`{"gemma": GemmaFields}` of a Gemma 4 text config (transformers' defaults where absent; the full
    layers' sizes from `per_layer_config` as transformers saves them, or the `global_*` keys).

    Example:
        >>> g = gemma_fields({"num_key_value_heads": 2, "global_head_dim": 16}, "x")["gemma"]
        >>> g.global_head_dim, g.global_kv_heads, g.global_rotary_factor
        (16, 2, 0.25)
    """
    for key, what in GEMMA_REFUSED:
        if d.get(key):
            raise ConfigError(f"{where}: {what} ('{key}': {d[key]!r}) are not supported for Gemma 4 targets")
    if d.get("use_bidirectional_attention") == "all":     # "vision": text tokens stay causal
        raise ConfigError(f"{where}: bidirectional attention ('use_bidirectional_attention': 'all') is not supported")
    k_eq_v = bool(d.get("attention_k_eq_v", False))
    kv = int(d.get("num_key_value_heads") or 4)
    head_dim, global_kv = int(d.get("global_head_dim") or 512), d.get("num_global_key_value_heads")
    global_kv = int(global_kv) if k_eq_v and global_kv else kv
    overrides = {tuple(sorted(v.items())) for v in (d.get("per_layer_config") or {}).values()}
    if len(overrides) > 1:
        raise ConfigError(f"{where}: per_layer_config gives the full layers different sizes: {overrides}")
    if overrides:
        o = dict(next(iter(overrides)))
        head_dim, global_kv = int(o.get("head_dim", head_dim)), int(o.get("num_key_value_heads", kv))
    full = (d.get("rope_parameters") or {}).get("full_attention") or {
        "rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6}
    rope_type = full.get("rope_type", "default")
    if rope_type not in ("default", "proportional") or full.get("factor", 1.0) != 1.0:
        raise ConfigError(f"{where}: full-attention rope {full} is not supported (default or proportional)")
    factor = float(full.get("partial_rotary_factor", 1.0)) if rope_type == "proportional" else 1.0
    return {"gemma": GemmaFields(head_dim, global_kv, k_eq_v, float(full.get("rope_theta", 1e6)), factor,
                                 float(d.get("final_logit_softcapping") or 0.0))}
