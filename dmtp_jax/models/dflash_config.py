"""The DFlash / DFlash2 drafter's config (`DFlashConfig`, read from and written to the z-lab
`config.json` layouts), its default capture layers, and the check that a drafter fits its target."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from dmtp_jax.config import ConfigError, validate_decoder_stack
from dmtp_jax.hf_config import require, stack_fields


ARCHITECTURE_VERSIONS = {"DFlashDraftModel": 1, "DFlash2DraftModel": 2}
DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """The reference's default capture layers (Python round-half-even, like `dflash`).

    Example:
        >>> build_target_layer_ids(36, 5)
        (1, 9, 17, 25, 33)
    """
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    span = num_target_layers - 3 - 1
    return tuple(round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers))


@dataclasses.dataclass(frozen=True)
class DFlashConfig:
    """A DFlash (version 1) or DFlash2 (version 2) drafter config. Layer field names match
    `TargetConfig` (the target's `Attention` and `DenseMLP` build the drafter layers);
    `sliding_window` is None unless `use_sliding_window`; `is_causal` is None (unset), True or False.

    Example:
        >>> dcfg = DFlashConfig.from_hf_dict({"architectures": ["DFlashDraftModel"], "hidden_size": 32,
        ...     "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        ...     "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 128,
        ...     "dflash_config": {"block_size": 8, "mask_token_id": 120, "target_layer_ids": [0, 1]}})
        >>> dcfg.version, dcfg.block_size, dcfg.to_hf_dict()["dflash_config"]["block_size"]
        (1, 8, 8)
    """

    version: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    is_causal: bool | None = None
    attention_bias: bool = False
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    conv_kernel_size: int = 0
    conv_group_size: int = 0
    selector_rank: int = 0
    selector_top_k: int = 0
    chained: ClassVar[bool] = False     # an EAGLE-3 drafter's config says True (`models/eagle3.py`)

    def __post_init__(self):
        where = f"drafter config (DFlash v{self.version})"
        if self.version not in (1, 2):
            raise ConfigError(f"{where}: 'version' must be 1 or 2")
        validate_decoder_stack(self, where, ("vocab_size", "block_size"))
        if not self.target_layer_ids:
            raise ConfigError(f"{where}: 'target_layer_ids' is empty")
        if self.final_logit_softcapping is not None and self.final_logit_softcapping <= 0:
            raise ConfigError(f"{where}: 'final_logit_softcapping' must be positive or unset")
        if self.version == 2:
            for key in DFLASH2_KEYS:
                if getattr(self, key) <= 0:
                    raise ConfigError(f"{where}: '{key}' must be positive, got {getattr(self, key)}")
            if self.hidden_size % self.conv_group_size:
                raise ConfigError(f"{where}: hidden_size={self.hidden_size} is not a multiple of "
                                  f"'conv_group_size'={self.conv_group_size}")
            if self.selector_top_k > self.vocab_size:
                raise ConfigError(f"{where}: 'selector_top_k'={self.selector_top_k} exceeds "
                                  f"vocab_size={self.vocab_size}")

    @property
    def num_context_features(self) -> int:
        """Width of the concatenated target features fed to `fc` (`len(target_layer_ids) * H`)."""
        return len(self.target_layer_ids) * self.hidden_size

    def layer_window(self, i: int) -> int | None:
        """Sliding window of drafter layer `i` (None for full attention or an unset window)."""
        return self.sliding_window if self.layer_types[i] == "sliding_attention" else None

    def layer_is_causal(self, i: int) -> bool:
        """In-block causality of layer `i`: `is_causal` if set, else True only for sliding layers."""
        if self.is_causal is None:
            return self.layer_types[i] == "sliding_attention"
        return bool(self.is_causal)

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "DFlashConfig":
        """From a drafter `config.json` dict (legacy top-level `block_size` or nested `dflash_config`);
        drafter keys are looked up in `dflash_config` first, then at the top level, like `dflash`."""
        nested = d.get("dflash_config") or {}
        if not isinstance(nested, dict):
            raise ConfigError("drafter config: 'dflash_config' must be an object")

        draft = {**d, **nested}          # drafter keys: `dflash_config` first, then the top level
        draft_value = draft.get

        archs = d.get("architectures") or []
        known = [a for a in archs if a in ARCHITECTURE_VERSIONS]
        if archs and not known:
            raise ConfigError(f"drafter config: 'architectures' {archs} names no DFlash drafter; "
                              f"expected one of {', '.join(ARCHITECTURE_VERSIONS)}")
        if known:
            version = ARCHITECTURE_VERSIONS[known[0]]
        else:
            version = 2 if all(draft_value(k) is not None for k in DFLASH2_KEYS) else 1
        where = f"drafter config (DFlash v{version})"

        fields = stack_fields(d, "qwen3", where)     # a Qwen3Config: hf_config's rules, like the targets
        fields.pop("partial_rotary_factor")
        num_target_layers = d.get("num_target_layers")
        layer_ids = draft_value("target_layer_ids")
        if layer_ids is None:
            layer_ids = build_target_layer_ids(int(require(d, "num_target_layers", where)),
                                               fields["num_hidden_layers"])
        is_causal = d.get("is_causal")
        softcap = draft_value("final_logit_softcapping")
        kwargs = dict(
            fields,
            version=version,
            intermediate_size=int(require(d, "intermediate_size", where)),
            vocab_size=int(d.get("vocab_size") or 151936),   # Qwen3Config's default
            block_size=int(draft_value("block_size", 16)),
            mask_token_id=int(require(draft, "mask_token_id", where)),
            target_layer_ids=tuple(int(i) for i in layer_ids),
            num_target_layers=int(num_target_layers) if num_target_layers is not None else None,
            is_causal=None if is_causal is None else bool(is_causal),
            input_embedding_scale=float(draft_value("input_embedding_scale", 1.0)),
            output_multiplier=float(draft_value("output_multiplier", 1.0)),
            final_logit_softcapping=float(softcap) if softcap is not None and float(softcap) > 0 else None,
        )
        if version == 2:
            kwargs.update({k: int(require(draft, k, where)) for k in DFLASH2_KEYS})
        return cls(**kwargs)

    def to_hf_dict(self) -> dict[str, Any]:
        """The `config.json` dict (nested `dflash_config` layout) that `dflash` loads."""
        nested: dict[str, Any] = {
            "block_size": self.block_size, "mask_token_id": self.mask_token_id,
            "target_layer_ids": list(self.target_layer_ids),
            "input_embedding_scale": self.input_embedding_scale,
            "output_multiplier": self.output_multiplier,
        }
        if self.final_logit_softcapping is not None:
            nested["final_logit_softcapping"] = self.final_logit_softcapping
        if self.version == 2:
            nested.update({k: getattr(self, k) for k in DFLASH2_KEYS})
        d: dict[str, Any] = {
            "architectures": ["DFlash2DraftModel" if self.version == 2 else "DFlashDraftModel"],
            "model_type": "qwen3", "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps, "hidden_act": "silu",
            "rope_parameters": {"rope_theta": self.rope_theta, "rope_type": "default"},
            "attention_bias": self.attention_bias, "tie_word_embeddings": False,
            "layer_types": list(self.layer_types), "sliding_window": self.sliding_window,
            "use_sliding_window": self.sliding_window is not None,
            # `dflash` evaluates build_target_layer_ids(config.num_target_layers, ...) eagerly.
            "num_target_layers": (self.num_target_layers if self.num_target_layers is not None
                                  else max(self.target_layer_ids) + 1),
            "dflash_config": nested,
        }
        if self.is_causal is not None:
            d["is_causal"] = self.is_causal
        return d


def check_hidden_and_taps(where: str, hidden_size: int, layer_ids, ids_key: str, target_cfg) -> None:
    """A drafter reading the target's features: its hidden size is the target's and every tapped
    layer id (`layer_ids`, config key `ids_key`) is one of the target's layers; else `ConfigError`
    (one line, `where`: ..., naming the key)."""
    if hidden_size != target_cfg.hidden_size:
        raise ConfigError(f"{where}: drafter 'hidden_size'={hidden_size} but the target's "
                          f"hidden_size={target_cfg.hidden_size}")
    bad = [i for i in layer_ids if not 0 <= i < target_cfg.num_hidden_layers]
    if bad:
        raise ConfigError(f"{where}: '{ids_key}' {list(layer_ids)} has ids {bad} "
                          f"outside the target's {target_cfg.num_hidden_layers} layers")


def check_fits_target(dcfg: DFlashConfig, target_cfg) -> None:
    """Raises `ConfigError` naming the key when the drafter cannot run on this target."""
    where = "drafter does not fit the target"
    check_hidden_and_taps(where, dcfg.hidden_size, dcfg.target_layer_ids, "target_layer_ids", target_cfg)
    if not 0 <= dcfg.mask_token_id < target_cfg.vocab_size:
        raise ConfigError(f"{where}: 'mask_token_id'={dcfg.mask_token_id} is outside the target "
                          f"vocab (vocab_size={target_cfg.vocab_size})")
    if dcfg.version == 2 and dcfg.vocab_size != target_cfg.vocab_size:
        raise ConfigError(f"{where}: drafter 'vocab_size'={dcfg.vocab_size} (selector codebooks) but "
                          f"the target's vocab_size={target_cfg.vocab_size}")
