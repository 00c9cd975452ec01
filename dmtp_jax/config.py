"""Configs as data: frozen dataclasses built from HF ``config.json`` and validated once.

Example:
    >>> cfg = TargetConfig.from_hf_dict({"model_type": "qwen3", "vocab_size": 128, "hidden_size": 32,
    ...     "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    ...     "num_key_value_heads": 2, "head_dim": 8})
    >>> cfg.num_kv_groups
    2
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

from dmtp_jax.errors import ConfigError, InputError  # noqa: F401  (ConfigError re-exported: callers import it from here)
from dmtp_jax.hf_config import (FAMILIES, GEMMA_FAMILIES, HYBRID_FAMILIES, MLA_FAMILIES, GemmaFields,
                                gemma_fields, mla_fields, require, stack_fields)

SUPPORTED_TARGET_TYPES = FAMILIES
# Hybrid (Gated DeltaNet + gated attention) families and the text-only spellings of their saves.
HYBRID_TARGET_TYPES = HYBRID_FAMILIES
MODEL_TYPE_ALIASES = {"qwen3_5_text": "qwen3_5", "qwen3_5_moe_text": "qwen3_5_moe", "gemma4_text": "gemma4"}
LAYER_TYPES = ("full_attention", "sliding_attention", "linear_attention")
# transformers' architecture and config model_type for each family (text-only saves)
HF_NAMES = {"qwen3": ("Qwen3ForCausalLM", "qwen3"), "qwen3_moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
            "qwen3_5": ("Qwen3_5ForCausalLM", "qwen3_5_text"),
            "qwen3_5_moe": ("Qwen3_5MoeForCausalLM", "qwen3_5_moe_text"),
            "qwen3_next": ("Qwen3NextForCausalLM", "qwen3_next"),
            "deepseek_v3": ("DeepseekV3ForCausalLM", "deepseek_v3"),
            "glm4_moe_lite": ("Glm4MoeLiteForCausalLM", "glm4_moe_lite"),
            "gemma4": ("Gemma4ForCausalLM", "gemma4_text")}


def text_config_dict(d: dict[str, Any]) -> dict[str, Any]:
    """The text-model part of a config: a released image-text config nests it in `text_config`
    (keys missing there, e.g. `tie_word_embeddings`, fall back to the outer dict)."""
    inner = d.get("text_config")
    if not isinstance(inner, dict):
        return d
    merged = {k: v for k, v in d.items() if k not in ("text_config", "vision_config", "model_type")}
    merged.update(inner)
    return merged


def _eos_ids(d: dict) -> tuple[int, ...]:
    eos = d.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]))


def validate_decoder_stack(cfg, where: str, extra_positive: tuple[str, ...] = ()) -> None:
    """Checks shared by every Qwen3-style decoder stack config (target, MTP layer, DFlash drafter):
    positive sizes, GQA divisibility, even head_dim, one known layer type per layer."""
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim") + tuple(extra_positive):
        if getattr(cfg, key) <= 0:
            raise ConfigError(f"{where}: '{key}' must be positive, got {getattr(cfg, key)}")
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise ConfigError(f"{where}: num_attention_heads={cfg.num_attention_heads} is not a multiple"
                          f" of num_key_value_heads={cfg.num_key_value_heads}")
    if cfg.head_dim % 2:
        raise ConfigError(f"{where}: head_dim={cfg.head_dim} must be even for RoPE")
    if len(cfg.layer_types) != cfg.num_hidden_layers:
        raise ConfigError(f"{where}: layer_types has {len(cfg.layer_types)} entries for "
                          f"{cfg.num_hidden_layers} layers")
    for t in cfg.layer_types:
        if t not in LAYER_TYPES:
            raise ConfigError(f"{where}: unknown layer type '{t}' in layer_types")


@dataclasses.dataclass(frozen=True)
class TargetConfig:
    """A decoder-only Qwen-family target: Qwen3 dense / MoE, hybrid Qwen3.5 / Qwen3.6 (`qwen3_5`,
    `qwen3_5_moe`) and Qwen3-Next. `layer_types[i]`: "full_attention", "sliding_attention" or
    "linear_attention" (Gated DeltaNet); MoE fields are empty for dense models. Hybrid families use
    zero-centred `(1 + w)` RMSNorms, a sigmoid attention output gate and partial rotary embeddings.
    Gemma 4 (`gemma`): the stack fields are its sliding layers', `gemma` holds the full layers' own."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    # MoE (qwen3_moe)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    # Hybrid families (Qwen3.5 / Qwen3.6 / Qwen3-Next)
    partial_rotary_factor: float = 1.0
    zero_centred_norms: bool = False
    attn_output_gate: bool = False
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    shared_expert_intermediate_size: int = 0
    mtp_num_hidden_layers: int = 0
    # MLA families (DeepSeek-V3, GLM-4.7-Flash): `hf_config.mla_fields`; kv_lora_rank 0 = not MLA
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False
    rope_scaling: tuple[tuple[str, Any], ...] = ()     # yarn parameters, () = plain RoPE
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    # Gemma 4 (`hf_config.gemma_fields`): the full layers' sizes and RoPE, the logit soft-cap
    gemma: GemmaFields | None = None

    def __post_init__(self):
        where = f"config ({self.model_type})"
        if self.model_type not in SUPPORTED_TARGET_TYPES:
            raise ConfigError(
                f"unknown model_type '{self.model_type}'; supported: {', '.join(SUPPORTED_TARGET_TYPES)}")
        validate_decoder_stack(self, where, ("vocab_size",))
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ConfigError(f"{where}: 'sliding_window' must be positive or unset, got {self.sliding_window}")
        if not 0 < self.rotary_dim <= self.head_dim or self.rotary_dim % 2:
            raise ConfigError(f"{where}: partial_rotary_factor={self.partial_rotary_factor} gives "
                              f"{self.rotary_dim} rotary dims of head_dim={self.head_dim} (need even, > 0)")
        if self.linear_layers:
            if self.model_type not in HYBRID_TARGET_TYPES:
                raise ConfigError(f"{where}: linear_attention layers exist only in "
                                  f"{', '.join(HYBRID_TARGET_TYPES)}")
            for key in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                        "linear_value_head_dim", "linear_conv_kernel_dim"):
                if getattr(self, key) <= 0:
                    raise ConfigError(f"{where}: '{key}' must be positive for linear_attention layers")
            if self.linear_num_value_heads % self.linear_num_key_heads:
                raise ConfigError(f"{where}: linear_num_value_heads={self.linear_num_value_heads} is not a "
                                  f"multiple of linear_num_key_heads={self.linear_num_key_heads}")
        if self.is_mla:
            for key in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
                if getattr(self, key) <= 0:
                    raise ConfigError(f"{where}: '{key}' must be positive")
            if self.num_experts % self.n_group or not 0 < self.topk_group <= self.n_group:
                raise ConfigError(f"{where}: need n_routed_experts % n_group == 0 and 0 < topk_group <= n_group, "
                                  f"got {self.num_experts}, {self.n_group}, {self.topk_group}")
        if self.model_type in ("qwen3_moe", "qwen3_5_moe", "qwen3_next") + MLA_FAMILIES:
            if self.num_experts <= 0 or not 0 < self.num_experts_per_tok <= self.num_experts:
                raise ConfigError(f"{where}: need 0 < num_experts_per_tok <= num_experts, got "
                                  f"{self.num_experts_per_tok} and {self.num_experts}")
            if self.moe_intermediate_size <= 0:
                raise ConfigError(f"{where}: 'moe_intermediate_size' must be positive")

    @property
    def num_kv_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def rotary_dim(self) -> int:
        """Head dims that RoPE rotates (`int(head_dim * partial_rotary_factor)`, the leading ones; MLA:
        `qk_rope_head_dim`, the decoupled rotary part)."""
        return self.qk_rope_head_dim if self.is_mla else int(self.head_dim * self.partial_rotary_factor)

    @property
    def is_mla(self) -> bool:
        """Multi-head latent attention (DeepSeek-V3 / GLM-4.7-Flash): the cache holds one latent
        `[kv_lora_rank + qk_rope_head_dim]` per token and layer (`kv_cache_dims`)."""
        return self.kv_lora_rank > 0

    @property
    def kv_cache_dims(self) -> tuple[int, int, int, int]:
        """`(kv heads, query heads, key dim, value dim)` of one attention layer's cache: per-head K/V,
        or MLA's one latent "head" (the compressed K/V and the rotary key, read by every query head,
        so never split over heads) with no separate value."""
        if self.is_mla:
            return 1, 1, self.kv_lora_rank + self.qk_rope_head_dim, 0
        if self.gemma is not None:      # both layer types packed in heads of the common dim (`models/gemma4.py`)
            g = self.gemma
            dim = math.gcd(self.head_dim, g.global_head_dim)
            heads = max(self.num_key_value_heads * self.head_dim, g.global_kv_heads * g.global_head_dim) // dim
            return heads, self.num_attention_heads, dim, dim
        return self.num_key_value_heads, self.num_attention_heads, self.head_dim, self.head_dim

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """Layers with a KV cache (full or sliding attention), in order."""
        return tuple(i for i, t in enumerate(self.layer_types) if t != "linear_attention")

    @property
    def linear_layers(self) -> tuple[int, ...]:
        """Gated DeltaNet layers (recurrent state), in order."""
        return tuple(i for i, t in enumerate(self.layer_types) if t == "linear_attention")

    @property
    def linear_conv_dim(self) -> int:
        """Channels of the DeltaNet conv: q | k | v."""
        return (2 * self.linear_num_key_heads * self.linear_key_head_dim
                + self.linear_num_value_heads * self.linear_value_head_dim)

    @property
    def shared_expert(self) -> bool:
        return self.shared_expert_intermediate_size > 0

    def is_moe_layer(self, i: int) -> bool:
        """Which layers carry a sparse MLP: every layer of `qwen3_5_moe`; else transformers' rule
        (`mlp_only_layers`, `decoder_sparse_step`)."""
        if self.model_type == "qwen3_5_moe":
            return True
        if self.model_type in MLA_FAMILIES:         # dense layers: `mlp_only_layers` (hf_config.mla_fields)
            return i not in self.mlp_only_layers
        return (self.model_type in ("qwen3_moe", "qwen3_next") and i not in self.mlp_only_layers
                and self.num_experts > 0 and (i + 1) % self.decoder_sparse_step == 0)

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "TargetConfig":
        """Builds a config from a transformers `config.json` dict (both v4 and v5 key spellings;
        image-text configs are read from their `text_config`)."""
        if d.get("model_type") is None and not isinstance(d.get("text_config"), dict):
            raise ConfigError("config.json has no 'model_type'")
        d = text_config_dict(d)
        model_type = d.get("model_type")
        if model_type is None:
            raise ConfigError("config.json has no 'model_type'")
        model_type = MODEL_TYPE_ALIASES.get(model_type, model_type)
        if model_type not in SUPPORTED_TARGET_TYPES:
            raise ConfigError(
                f"unknown model_type '{model_type}'; supported: {', '.join(SUPPORTED_TARGET_TYPES)}")
        where = f"config ({model_type})"
        hybrid = model_type in HYBRID_TARGET_TYPES
        kwargs = dict(
            stack_fields(d, model_type, where),      # sizes, head dims, RoPE, layer types: hf_config's rules
            model_type=model_type,
            vocab_size=int(require(d, "vocab_size", where)),
            intermediate_size=int(d.get("intermediate_size") or 0) or 1,
            max_position_embeddings=int(d.get("max_position_embeddings", 32768)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            eos_token_ids=_eos_ids(d),
            pad_token_id=d.get("pad_token_id"),
        )
        if model_type in ("qwen3_moe", "qwen3_5_moe", "qwen3_next"):
            kwargs.update(
                num_experts=int(d.get("num_experts") or d.get("num_local_experts") or 0),
                num_experts_per_tok=int(d.get("num_experts_per_tok") or 0),
                moe_intermediate_size=int(d.get("moe_intermediate_size") or 0),
                # Qwen3.5-MoE always renormalises its top-k weights (the key was removed there)
                norm_topk_prob=bool(d.get("norm_topk_prob", model_type != "qwen3_moe")),
                decoder_sparse_step=int(d.get("decoder_sparse_step", 1)),
                mlp_only_layers=tuple(int(i) for i in d.get("mlp_only_layers") or ()),
                shared_expert_intermediate_size=int(d.get("shared_expert_intermediate_size") or 0),
            )
        if model_type in MLA_FAMILIES:
            kwargs.update(mla_fields(d, where))
        if model_type in GEMMA_FAMILIES:
            kwargs.update(gemma_fields(d, where), tie_word_embeddings=bool(d.get("tie_word_embeddings", True)))
        if hybrid:
            kwargs.update(
                zero_centred_norms=True, attn_output_gate=True,
                linear_num_key_heads=int(d.get("linear_num_key_heads", 16)),
                linear_num_value_heads=int(d.get("linear_num_value_heads", 32)),
                linear_key_head_dim=int(d.get("linear_key_head_dim", 128)),
                linear_value_head_dim=int(d.get("linear_value_head_dim", 128)),
                linear_conv_kernel_dim=int(d.get("linear_conv_kernel_dim", 4)),
                mtp_num_hidden_layers=int(d.get("mtp_num_hidden_layers")
                                          or d.get("num_nextn_predict_layers") or 0),
            )
        return cls(**kwargs)

    def to_hf_dict(self) -> dict[str, Any]:
        """The transformers `config.json` dict for this config (loads with `AutoConfig`; hybrid
        families are saved in their text-only form)."""
        arch, hf_type = HF_NAMES[self.model_type]
        d = {
            "architectures": [arch], "model_type": hf_type, "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps, "hidden_act": "silu",
            "rope_parameters": {"rope_theta": self.rope_theta, "rope_type": "default"},
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings, "attention_bias": self.attention_bias,
            "layer_types": list(self.layer_types), "sliding_window": self.sliding_window,
            "use_sliding_window": self.sliding_window is not None,
            "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) > 1 else (
                self.eos_token_ids[0] if self.eos_token_ids else None),
            "pad_token_id": self.pad_token_id,
        }
        if self.model_type in ("qwen3_moe", "qwen3_next"):
            d.update(norm_topk_prob=self.norm_topk_prob, decoder_sparse_step=self.decoder_sparse_step,
                     mlp_only_layers=list(self.mlp_only_layers))
        if self.num_experts:
            d.update(num_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
                     moe_intermediate_size=self.moe_intermediate_size)
        if self.shared_expert:
            d["shared_expert_intermediate_size"] = self.shared_expert_intermediate_size
        if self.model_type in HYBRID_TARGET_TYPES:
            d["rope_parameters"]["partial_rotary_factor"] = self.partial_rotary_factor
            d.update(linear_num_key_heads=self.linear_num_key_heads,
                     linear_num_value_heads=self.linear_num_value_heads,
                     linear_key_head_dim=self.linear_key_head_dim,
                     linear_value_head_dim=self.linear_value_head_dim,
                     linear_conv_kernel_dim=self.linear_conv_kernel_dim)
            for key in ("sliding_window", "use_sliding_window"):
                d.pop(key)
            if self.model_type == "qwen3_5_moe":
                d.pop("intermediate_size")
            if self.mtp_num_hidden_layers:
                d["mtp_num_hidden_layers"] = self.mtp_num_hidden_layers
        if self.is_mla:
            d.update(q_lora_rank=self.q_lora_rank or None, kv_lora_rank=self.kv_lora_rank,
                     qk_nope_head_dim=self.qk_nope_head_dim, qk_rope_head_dim=self.qk_rope_head_dim,
                     v_head_dim=self.v_head_dim, head_dim=self.qk_rope_head_dim, rope_interleave=self.rope_interleave,
                     n_routed_experts=self.num_experts, norm_topk_prob=self.norm_topk_prob,
                     n_shared_experts=self.shared_expert_intermediate_size // self.moe_intermediate_size,
                     n_group=self.n_group, topk_group=self.topk_group, routed_scaling_factor=self.routed_scaling_factor,
                     mlp_layer_types=["sparse" if self.is_moe_layer(i) else "dense"
                                      for i in range(self.num_hidden_layers)],
                     num_key_value_heads=self.num_attention_heads,
                     num_nextn_predict_layers=self.mtp_num_hidden_layers)
            d["first_k_dense_replace"] = len(self.mlp_only_layers)
            if self.rope_scaling:
                d["rope_parameters"] = dict(self.rope_scaling, rope_theta=self.rope_theta, rope_type="yarn")
            for key in ("layer_types", "sliding_window", "use_sliding_window", "num_experts"):
                d.pop(key, None)
        if self.gemma is not None:
            g = self.gemma
            d.update(hidden_activation="gelu_pytorch_tanh", global_head_dim=g.global_head_dim,
                     num_global_key_value_heads=g.global_kv_heads, attention_k_eq_v=g.k_eq_v,
                     final_logit_softcapping=g.final_logit_softcapping or None, hidden_size_per_layer_input=0,
                     vocab_size_per_layer_input=0, rope_parameters={
                         "sliding_attention": {"rope_type": "default", "rope_theta": self.rope_theta},
                         "full_attention": {"rope_type": "proportional", "rope_theta": g.global_rope_theta,
                                            "partial_rotary_factor": g.global_rotary_factor}})
            for key in ("hidden_act", "use_sliding_window"):
                d.pop(key)
        return d


def read_config_json(model_dir: str | os.PathLike) -> dict[str, Any]:
    """Reads `<model_dir>/config.json` (or `model_dir` itself when a `.json` file); one clear error when
    missing or unreadable."""
    path = os.path.join(model_dir, "config.json")
    if str(model_dir).endswith(".json") and os.path.isfile(model_dir):
        path = model_dir
    elif not os.path.isdir(model_dir):
        raise ConfigError(f"model directory not found: {model_dir}")
    if not os.path.isfile(path):
        raise ConfigError(f"no config.json in {model_dir}")
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"cannot read {path}: {e}") from None


def load_target_config(model_dir: str | os.PathLike) -> TargetConfig:
    """Loads and validates the target config of an HF model directory."""
    return TargetConfig.from_hf_dict(read_config_json(model_dir))


def check_config_keys(cls, d: dict, what: str) -> None:
    """Raises one `InputError` naming the keys of `d` that are not fields of the dataclass `cls`."""
    names = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    unknown = sorted(set(d) - names)
    if unknown:
        raise InputError(f"unknown {what} config keys: {', '.join(unknown)}")
