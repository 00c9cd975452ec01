"""HF name tables of Gemma 4: the text target and its `gemma4_assistant` drafter.

Target: the Qwen table plus the sandwich norms (`pre_feedforward_layernorm`,
`post_feedforward_layernorm`) and each layer's `layer_scalar`; full layers under `attention_k_eq_v`
have no `v_proj`, and `v_norm` has no weight. Image-text saves (`Gemma4ForConditionalGeneration`)
keep the text model under `model.language_model.*` (`hf.image_text_rules`) and their vision / audio
towers are not read.

Assistant (`Gemma4AssistantForCausalLM`): its layers under `model.layers.*` (the target's layer
names, with no K/V projections), `model.norm`, `model.embed_tokens` (its LM head, tied),
`pre_projection` / `post_projection`, and with ordered embeddings `masked_embedding.centroids` and
`masked_embedding.token_ordering`.

Example:
    >>> assistant_rules(())[0]
    ('pre_projection', 'pre_projection.weight', 'T')
"""

from __future__ import annotations

GEMMA_LAYER_RULES = (
    (r"layers\.(\d+)\.(pre_feedforward_layernorm|post_feedforward_layernorm)", r"model.layers.\1.\2.weight", "copy"),
    (r"layers\.(\d+)\.layer_scalar", r"model.layers.\1.layer_scalar", "copy"),
)
# Tensors of an image-text save that the text target does not read.
GEMMA_IGNORED_PREFIXES = ("model.vision_tower.", "model.audio_tower.", "model.embed_vision.", "model.embed_audio.")

ASSISTANT_RULES = (
    (r"pre_projection", "pre_projection.weight", "T"),
    (r"post_projection", "post_projection.weight", "T"),
    (r"centroids", "masked_embedding.centroids.weight", "T"),
    (r"token_ordering", "masked_embedding.token_ordering", "copy"),
)


def gemma_target_rules(base_rules) -> tuple:
    """The target table: the Gemma names first, then `base_rules` (the Qwen table)."""
    return GEMMA_LAYER_RULES + tuple(base_rules)


def assistant_rules(base_rules) -> tuple:
    """The assistant's table: its own four names, then the target table (its layers, norm, embedding)."""
    return ASSISTANT_RULES + gemma_target_rules(base_rules)
