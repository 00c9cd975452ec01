"""Tiny random `dflash` reference drafters for the JAX parity tests (no download).

`build_reference_drafter(out_dir, ...)` makes a `dflash.model.DFlashDraftModel` (or
`DFlash2DraftModel`) matching the tiny target of `tests/conftest.py` (hidden 32, 2 target layers,
vocab 128), fills every weight -- norms U(0.5, 1.5), DFlash2 base kernels and codebooks included --
from `torch.manual_seed(seed)`, saves it with `save_pretrained` and returns the torch model.

`reference_draft_calls(...)` runs the reference drafter exactly as `dflash.model.dflash_generate`
does: a draft `DynamicCache` with past recording, `target_hidden` = only the newly committed
context rows, position ids `[start - ctx_len, start + block)`, then `_crop_to(cache, start)`.

Example:
    model = build_reference_drafter(str(tmp_path / "d"), layer_types=("sliding_attention",) * 2)
"""

from __future__ import annotations

import math

MASK_TOKEN_ID = 120
BLOCK_SIZE = 8
TINY_DRAFTER = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6,
                    max_position_embeddings=512, num_target_layers=2)
DFLASH2_KEYS = dict(conv_kernel_size=2, conv_group_size=8, selector_rank=6, selector_top_k=5)


def reference_config(*, version: int = 1, layer_types=("full_attention", "full_attention"),
                     sliding_window: int | None = None, is_causal: bool | None = None,
                     layout: str = "nested", **draft_keys):
    """A `Qwen3Config` for a tiny reference drafter (`layout` "nested" or "legacy")."""
    from transformers import Qwen3Config

    nested = dict(mask_token_id=MASK_TOKEN_ID, target_layer_ids=[0, 1], **draft_keys)
    top = dict(TINY_DRAFTER, layer_types=list(layer_types))
    if sliding_window is not None:
        top.update(sliding_window=sliding_window, use_sliding_window=True)
    if is_causal is not None:
        top["is_causal"] = is_causal
    if layout == "legacy":
        top.update(block_size=BLOCK_SIZE, rope_theta=10000.0)
    else:
        nested["block_size"] = BLOCK_SIZE
        top["rope_parameters"] = {"rope_theta": 10000.0, "rope_type": "default"}
    if version == 2:
        nested.update(DFLASH2_KEYS)
    cfg = Qwen3Config(**top, dflash_config=nested)
    cfg.architectures = ["DFlash2DraftModel" if version == 2 else "DFlashDraftModel"]
    return cfg


def build_reference_drafter(out_dir: str | None, *, version: int = 1, seed: int = 0, **cfg_kwargs):
    """Builds, randomizes and (when `out_dir`) saves a tiny reference drafter; returns the model.

    Example:
        >>> m = build_reference_drafter("/tmp/d", version=2, is_causal=False)  # doctest: +SKIP
    """
    import torch
    from dflash.model import DFlash2DraftModel, DFlashDraftModel

    torch.manual_seed(seed)
    cfg = reference_config(version=version, **cfg_kwargs)
    model = (DFlash2DraftModel if version == 2 else DFlashDraftModel)(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith("base_kernel"):
                p.normal_(0.5, 0.5)
            elif "codebook" in name:
                p.normal_(0.0, 1.0)
            elif p.ndim == 2:
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[1]))
            else:
                p.normal_(0.0, 0.1)
    if out_dir is not None:
        model.save_pretrained(out_dir)
    return model


def reference_draft_calls(model, target, prompt_ids, steps):
    """Runs the reference drafter for consecutive rounds the way `dflash_generate` does.

    `steps` is a list of `(n_new_ctx, anchor_token)`: each round appends `n_new_ctx` committed
    tokens' target features (the first round: the whole prompt) and drafts a block at
    `start = committed length` whose anchor is `anchor_token`. `prompt_ids [1, N]` holds every
    committed token. Returns a list of `(start, block_ids [1, B], draft_hidden [1, B, H])`.
    """
    import torch
    from dflash.model import (_crop_to, _draft_value, _make_cache, _raw_input_embeddings,
                              extract_context_feature)

    with torch.no_grad():
        out = target(prompt_ids, output_hidden_states=True)
        features = extract_context_feature(out.hidden_states, model.target_layer_ids)
        cache = _make_cache(model.config)
        positions = torch.arange(prompt_ids.shape[1] + model.block_size)[None]
        start, results = 0, []
        for n_new, anchor in steps:
            ctx = features[:, start:start + n_new]
            start += n_new
            block = torch.full((1, model.block_size), model.mask_token_id, dtype=torch.long)
            block[0, 0] = anchor
            scale = float(_draft_value(model.config, "input_embedding_scale", 1.0))
            noise = _raw_input_embeddings(target, block, scale)
            hidden = model(target_hidden=ctx, noise_embedding=noise,
                           position_ids=positions[:, start - ctx.shape[1]:start + model.block_size],
                           past_key_values=cache, use_cache=True)
            _crop_to(cache, start)
            results.append((start, block, hidden))
    return results


def randomized(fusion, seed):
    """The fusion with every weight replaced by noise (so the fusion really acts)."""
    import jax
    leaves, treedef = jax.tree.flatten(fusion.state)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    fusion.state = jax.tree.unflatten(treedef, [0.3 * jax.random.normal(k, x.shape, x.dtype) + (x.ndim == 1)
                                                for k, x in zip(keys, leaves)])
    return fusion


def saved_dmtp_drafter(out_dir: str, target_cfg, method: str = "dmtp", *, fusion_seed: int = 0,
                       dflash_dir: str | None = None) -> str:
    """A saved `method` DMTP drafter in `out_dir` with noise fusion weights (`randomized`), from the
    DFlash drafter in `dflash_dir` (default: a fresh reference drafter, seed 3, a sliding-window
    layer then a full one, built next to `out_dir`); returns `out_dir`."""
    from dmtp_jax.checkpoint.dmtp_ckpt import load_dmtp_drafter, save_dmtp_drafter
    if dflash_dir is None:
        dflash_dir = out_dir + "-dflash"
        build_reference_drafter(dflash_dir, seed=3, layer_types=("sliding_attention", "full_attention"),
                                sliding_window=6)
    drafter, fusion = load_dmtp_drafter(dflash_dir, target_cfg, method)
    save_dmtp_drafter(drafter, randomized(fusion, fusion_seed), out_dir)
    return out_dir
