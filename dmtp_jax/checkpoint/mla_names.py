"""HF name tables of the MLA families (DeepSeek-V3, GLM-4.7-Flash): the target's layers and the
next-token layer stored after them (`model.layers.{L}.*`), mapped onto our MTP head (docs/models-detail.md).

Example:
    >>> nextn_rules((), 47)[0]
    ('pre_fc_norm_embedding', 'layers.47.enorm.weight', 'copy')
"""

from __future__ import annotations

import re

MLA_LAYER_RULES = (
    (r"layers\.(\d+)\.self_attn\.(q_a_proj|q_b_proj|q_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj)",
     r"model.layers.\1.self_attn.\2.weight", "T"),
    (r"layers\.(\d+)\.self_attn\.(q_a_layernorm|kv_a_layernorm)", r"model.layers.\1.self_attn.\2.weight", "copy"),
    (r"layers\.(\d+)\.mlp\.e_score_correction_bias", r"model.layers.\1.mlp.gate.e_score_correction_bias", "copy"),
    (r"layers\.(\d+)\.mlp\.shared_experts\.(gate|up|down)_proj", r"model.layers.\1.mlp.shared_experts.\2_proj.weight",
     "T"),
)
NEXTN_RULES = (
    (r"pre_fc_norm_embedding", "enorm.weight", "copy"),
    (r"pre_fc_norm_hidden", "hnorm.weight", "copy"),
    (r"fc", "eh_proj.weight", "T"),
    (r"norm", "shared_head.norm.weight", "copy"),
)
NEXTN_PREFIX = "model."         # the tables below name `layers.{L}.*` under it
NEXTN_TENSOR = re.compile(r"^model\.layers\.(\d+)\.eh_proj\.weight$")


def mla_target_rules(base_rules) -> tuple:
    """The target table: `base_rules` (the Qwen table) with the MLA / DeepSeek-MoE names first."""
    return MLA_LAYER_RULES + tuple(base_rules)


def nextn_rules(base_rules, layer: int) -> tuple:
    """The table of next-token layer `layer` (= num_hidden_layers for the first), under
    `NEXTN_PREFIX`: its own four names, then its decoder layer's (the target table's
    `model.layers.{i}.*` rules, our `layers.0.*` as `layers.{layer}.*`)."""
    own = tuple((p, f"layers.{layer}.{t}", how) for p, t, how in NEXTN_RULES)
    body = tuple((p, t.replace(r"model.layers.\1.", f"layers.{layer}."), how)
                 for p, t, how in mla_target_rules(base_rules) if p.startswith(r"layers\.(\d+)\."))
    return own + body


def is_nextn_tensor(name: str, num_hidden_layers: int) -> bool:
    """Whether `name` belongs to a next-token layer (`model.layers.{i}.*`, i >= num_hidden_layers).

    Example:
        >>> is_nextn_tensor("model.layers.47.eh_proj.weight", 47), is_nextn_tensor("model.layers.3.x", 47)
        (True, False)
    """
    m = re.match(r"^model\.layers\.(\d+)\.", name)
    return bool(m) and int(m.group(1)) >= num_hidden_layers
