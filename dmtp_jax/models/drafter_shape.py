"""The drafter shape a target gets when none is given (`train.py`'s fresh drafters, `plan`'s default)."""

from __future__ import annotations

from dmtp_jax.models.dflash_config import DFlashConfig, build_target_layer_ids

DEFAULT_DRAFT_LAYERS = 5      # every published z-lab / SpecForge DFlash drafter
DEFAULT_PLAN_BLOCK = 8        # DMTP's eight slots


def default_target_layer_ids(num_target_layers: int, draft_layers: int) -> tuple[int, ...]:
    """`dflash`'s default capture layers (`build_target_layer_ids`), or evenly spaced ones for
    targets too shallow for them.

    Example:
        >>> default_target_layer_ids(36, 5), default_target_layer_ids(2, 2)
        ((1, 9, 17, 25, 33), (0, 1))
    """
    ids = build_target_layer_ids(num_target_layers, draft_layers)
    if all(0 <= i < num_target_layers for i in ids) and len(set(ids)) == len(ids):
        return ids
    span = num_target_layers - 1
    return tuple(sorted({int(round(i * span / max(1, draft_layers - 1))) for i in range(draft_layers)}))


def default_mask_token(target_cfg) -> int:
    """The highest id that is not an EOS id (a drafter's mask token when no tokenizer names one)."""
    i = target_cfg.vocab_size - 1
    while i in set(target_cfg.eos_token_ids):
        i -= 1
    return i


def default_drafter_config(target_cfg, num_layers: int = DEFAULT_DRAFT_LAYERS, block_size: int = DEFAULT_PLAN_BLOCK,
                           *, intermediate_size: int | None = None, target_layer_ids=None,
                           mask_token_id: int | None = None) -> DFlashConfig:
    """A fresh DFlash (version 1) drafter shaped like its target: `num_layers` Qwen3 layers of the
    target's width, heads and head dim; the target's dense intermediate size (3 x hidden for an
    all-MoE target) unless given; context from `default_target_layer_ids`; full attention; mask token
    `default_mask_token` unless given.

    Example:
        >>> from dmtp_jax.config import TargetConfig
        >>> t = TargetConfig.from_hf_dict({"model_type": "qwen3", "vocab_size": 64, "hidden_size": 16,
        ...     "intermediate_size": 32, "num_hidden_layers": 8, "num_attention_heads": 2,
        ...     "num_key_value_heads": 1, "head_dim": 8})
        >>> default_drafter_config(t).target_layer_ids, default_drafter_config(t, num_layers=2).num_hidden_layers
        ((1, 2, 3, 4, 5), 2)
    """
    inter = intermediate_size or target_cfg.intermediate_size
    if inter < target_cfg.hidden_size and not intermediate_size:     # an all-MoE target: no dense MLP width
        inter = 3 * target_cfg.hidden_size
    n = target_cfg.num_hidden_layers
    ids = target_layer_ids or default_target_layer_ids(n, num_layers)
    mask = default_mask_token(target_cfg) if mask_token_id is None else mask_token_id
    return DFlashConfig.from_hf_dict({
        "architectures": ["DFlashDraftModel"], "hidden_size": target_cfg.hidden_size,
        "intermediate_size": inter, "num_hidden_layers": num_layers,
        "num_attention_heads": target_cfg.num_attention_heads,
        "num_key_value_heads": target_cfg.num_key_value_heads, "head_dim": target_cfg.head_dim,
        "vocab_size": target_cfg.vocab_size, "rms_norm_eps": target_cfg.rms_norm_eps,
        "rope_theta": target_cfg.rope_theta, "num_target_layers": n,
        "dflash_config": {"block_size": block_size, "mask_token_id": mask, "target_layer_ids": list(ids)}})
