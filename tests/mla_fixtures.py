"""Tiny random DeepSeek-V3 / GLM-4.7-Flash (`glm4_moe_lite`) checkpoints written by transformers
itself (no download), with a random next-token layer stored after the decoder layers
(`model.layers.{L}.*`). Shared by the MLA parity and sharding tests; transformers and torch are
imported only when a checkpoint is built."""

from __future__ import annotations

import copy
import math
import os

TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
            num_experts_per_tok=2, kv_lora_rank=16, qk_rope_head_dim=8, v_head_dim=12, qk_nope_head_dim=16,
            max_position_embeddings=256, rms_norm_eps=1e-6, routed_scaling_factor=2.5, eos_token_id=1)
FAMILIES = {
    # DeepSeek-V3: low-rank queries, grouped routing, a dense first layer, YaRN RoPE
    "deepseek_v3": dict(q_lora_rank=24, n_group=2, topk_group=1, first_k_dense_replace=1,
                        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                         "original_max_position_embeddings": 64, "mscale": 1.0,
                                         "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}),
    # GLM-4.7-Flash's shape: one q_proj (no q LoRA here, to cover it), one group, plain RoPE
    "glm4_moe_lite": dict(q_lora_rank=None, n_group=1, topk_group=1, mlp_layer_types=["dense", "sparse"],
                          num_nextn_predict_layers=1,      # the released config.json's key
                          rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
}


def randomize(module, seed):
    """Every weight random (norms around 1, router bias non-zero), so no part is an identity."""
    import torch

    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in list(module.named_parameters()) + list(module.named_buffers()):
            if "inv_freq" in name:
                continue
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif "e_score_correction_bias" in name:
                p.normal_(0.0, 0.3)
            elif p.ndim >= 2:
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[-1]))


def nextn_layer(hf_cfg, seed):
    """The next-token layer's modules in torch: enorm, hnorm, eh_proj, a decoder layer of the target's
    class at index L, shared_head.norm."""
    import torch

    mod = __import__(f"transformers.models.{hf_cfg.model_type}.modeling_{hf_cfg.model_type}", fromlist=["x"])
    prefix = {"deepseek_v3": "DeepseekV3", "glm4_moe_lite": "Glm4MoeLite"}[hf_cfg.model_type]
    norm = getattr(mod, f"{prefix}RMSNorm")
    h = hf_cfg.hidden_size
    if getattr(hf_cfg, "mlp_layer_types", None):             # GLM names every layer's MLP kind
        hf_cfg = copy.deepcopy(hf_cfg)
        hf_cfg.mlp_layer_types = list(hf_cfg.mlp_layer_types) + ["sparse"]
    layer = torch.nn.ModuleDict(dict(
        enorm=norm(h, eps=hf_cfg.rms_norm_eps), hnorm=norm(h, eps=hf_cfg.rms_norm_eps),
        eh_proj=torch.nn.Linear(2 * h, h, bias=False),
        block=getattr(mod, f"{prefix}DecoderLayer")(hf_cfg, hf_cfg.num_hidden_layers),
        head_norm=norm(h, eps=hf_cfg.rms_norm_eps)))
    randomize(layer, seed)
    return layer.eval()


def nextn_tensors(layer, hf_model, n_layers):
    """The next-token layer's tensors in the HF layout (`model.layers.{L}.*`, experts per expert as
    transformers saves them, plus the copies of the embedding and head the layout carries)."""
    p = f"model.layers.{n_layers}."
    out = {p + "enorm.weight": layer["enorm"].weight, p + "hnorm.weight": layer["hnorm"].weight,
           p + "eh_proj.weight": layer["eh_proj"].weight, p + "shared_head.norm.weight": layer["head_norm"].weight,
           p + "shared_head.head.weight": hf_model.lm_head.weight,
           p + "embed_tokens.weight": hf_model.model.embed_tokens.weight}
    for name, t in layer["block"].state_dict().items():
        if name.endswith("experts.gate_up_proj"):
            inter = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{p}mlp.experts.{e}.gate_proj.weight"] = t[e, :inter]
                out[f"{p}mlp.experts.{e}.up_proj.weight"] = t[e, inter:]
        elif name.endswith("experts.down_proj"):
            for e in range(t.shape[0]):
                out[f"{p}mlp.experts.{e}.down_proj.weight"] = t[e]
        else:
            out[p + name] = t
    return {k: v.detach().contiguous().clone() for k, v in out.items()}


def build(family, out_dir, seed):
    """A tiny random `family` checkpoint saved by transformers, with a next-token layer added."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_cfg = AutoConfig.for_model(family, **TINY, **FAMILIES[family])
    hf_cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_cfg).eval()
    randomize(model, seed)
    model.save_pretrained(out_dir)
    layer = nextn_layer(hf_cfg, seed + 1)
    path = os.path.join(out_dir, "model.safetensors")
    tensors = load_file(path)
    tensors.update(nextn_tensors(layer, model, hf_cfg.num_hidden_layers))
    save_file(tensors, path, metadata={"format": "pt"})
    return model, layer
