"""Tiny random Gemma 4 checkpoints written by transformers itself (no download): the text target
(sliding and full layers of their own sizes, keys as values, proportional RoPE, soft-capped logits)
and its `gemma4_assistant` (8 centroids, top 2, a random token ordering). Shared by the Gemma parity,
sharding and compare tests; transformers and torch are imported only when a checkpoint is built."""

from __future__ import annotations

import math

WINDOW = 8
TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, global_head_dim=16, num_global_key_value_heads=1,
            attention_k_eq_v=True, sliding_window=WINDOW, final_logit_softcapping=5.0,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
            hidden_size_per_layer_input=0, vocab_size_per_layer_input=0, max_position_embeddings=256,
            eos_token_id=1, pad_token_id=0, bos_token_id=2)
ASSISTANT = dict(TINY, hidden_size=16, intermediate_size=32, num_hidden_layers=2, final_logit_softcapping=None,
                 layer_types=["sliding_attention", "full_attention"])


def randomize(module, seed):
    """Every weight random (norms and layer scalars around 1), so no part is an identity."""
    import torch

    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in list(module.named_parameters()) + list(module.named_buffers()):
            if "inv_freq" in name or "embed_scale" in name or "token_ordering" in name:
                continue
            if name.endswith("norm.weight") or name.endswith("layer_scalar"):
                p.uniform_(0.5, 1.5)
            elif p.ndim >= 2:
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[-1]))


def build_tiny_gemma4(target_dir: str, assistant_dir: str):
    """Writes the tiny target to `target_dir` and its assistant to `assistant_dir`; returns the
    transformers models `(target, assistant)` (eval mode, eager attention)."""
    import torch
    from transformers import (Gemma4AssistantConfig, Gemma4AssistantForCausalLM, Gemma4ForCausalLM,
                              Gemma4TextConfig)

    hf_cfg = Gemma4TextConfig(**TINY)
    hf_cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = Gemma4ForCausalLM(hf_cfg).eval()
    randomize(model, 0)
    model.save_pretrained(target_dir)
    a_cfg = Gemma4AssistantConfig(text_config=ASSISTANT, backbone_hidden_size=TINY["hidden_size"],
                                  use_ordered_embeddings=True, num_centroids=8, centroid_intermediate_top_k=2)
    a_cfg.text_config._attn_implementation = a_cfg._attn_implementation = "eager"
    assistant = Gemma4AssistantForCausalLM(a_cfg).eval()
    randomize(assistant, 1)
    with torch.no_grad():
        assistant.masked_embedding.token_ordering.copy_(torch.randperm(128, generator=torch.Generator().manual_seed(0)))
    assistant.save_pretrained(assistant_dir)
    return model, assistant
