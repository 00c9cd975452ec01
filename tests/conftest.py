"""Shared pytest fixtures: tiny random HF checkpoints built with transformers + torch (no download).

Fixtures (session-scoped, built once per test run into a pytest tmp dir):

* ``tiny_qwen3_dir``     -- a ``Qwen3ForCausalLM`` directory (``config.json``, ``model.safetensors``
  in fp32, ``generation_config.json``); no tokenizer.
* ``tiny_qwen3_moe_dir`` -- a ``Qwen3MoeForCausalLM`` directory, every layer sparse (4 experts, top-2,
  ``norm_topk_prob=True``, ``moe_intermediate_size`` 16).

Both: vocab 128, hidden 32, 2 layers, 4 heads, 2 KV heads, head_dim 8, max_position_embeddings 512,
rope theta 10000, eos id 127, untied LM head, ``initializer_range=0.1`` (logits of order 1, so argmax
is not decided by rounding noise; greedy continuations vary rather than repeat one token, which they
do with tied embeddings), and every RMSNorm weight (input / post-attention / q / k / final) drawn from
U(0.5, 1.5) so that the norms are exercised. Weights come from ``torch.manual_seed(seed)``, hence are
the same on every run. Use ``build_tiny_checkpoint(out_dir, "qwen3" | "qwen3_moe", seed, **overrides)``
directly for a private copy or a variant (e.g. ``tie_word_embeddings=True``).

Example:
    def test_loads(tiny_qwen3_dir):
        from dmtp_jax.checkpoint.hf import load_target
        assert load_target(tiny_qwen3_dir).cfg.num_hidden_layers == 2
"""

from __future__ import annotations

import pytest

TINY_COMMON = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                   max_position_embeddings=512, rms_norm_eps=1e-6, initializer_range=0.1,
                   eos_token_id=127, bos_token_id=None, pad_token_id=None)
TINY_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True,
                decoder_sparse_step=1, mlp_only_layers=[])


def build_tiny_checkpoint(out_dir: str, family: str = "qwen3", seed: int = 0, **overrides) -> str:
    """Writes a tiny random HF checkpoint of `family` ("qwen3" or "qwen3_moe") to `out_dir`;
    `overrides` replace config fields (e.g. `tie_word_embeddings=True`, `num_hidden_layers=3`).

    Example:
        >>> build_tiny_checkpoint("/tmp/tiny-moe", "qwen3_moe")  # doctest: +SKIP
        '/tmp/tiny-moe'
    """
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    fields = {**TINY_COMMON, "tie_word_embeddings": False}
    if family == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**{**fields, **overrides}))
    elif family == "qwen3_moe":
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**{**fields, **TINY_MOE, **overrides}))
    else:
        raise ValueError(f"unknown tiny family '{family}'")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    model.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory) -> str:
    """Path of a tiny dense Qwen3 checkpoint (see module docstring). Treat it as read-only."""
    return build_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny-qwen3")), "qwen3", seed=0)


@pytest.fixture(scope="session")
def tiny_qwen3_moe_dir(tmp_path_factory) -> str:
    """Path of a tiny Qwen3-MoE checkpoint (see module docstring). Treat it as read-only."""
    return build_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny-qwen3-moe")), "qwen3_moe", seed=1)


BOOSTED_ROWS = (10, 11, 12, 13, 14, 15)


@pytest.fixture(scope="session")
def peaked_target_dir(tiny_qwen3_dir, tmp_path_factory) -> str:
    """The tiny Qwen3 target with a few LM-head rows scaled up, so that target and drafters (which
    share the head) often agree: acceptance is partial, neither always 0 nor always full."""
    import os
    import shutil

    import numpy as np

    from dmtp_jax.checkpoint.safetensors_io import CheckpointReader, write_safetensors

    d = str(tmp_path_factory.mktemp("peaked") / "target")
    shutil.copytree(tiny_qwen3_dir, d)
    reader = CheckpointReader(d)
    tensors = {k: np.array(reader.array(k)) for k in reader.keys()}
    del reader
    tensors["lm_head.weight"][list(BOOSTED_ROWS)] *= 6.0
    write_safetensors(os.path.join(d, "model.safetensors"), tensors)
    return d


@pytest.fixture(scope="session")
def mtp_target_dir(peaked_target_dir, tmp_path_factory) -> str:
    """`peaked_target_dir` plus a random native MTP head (`mtp.*` tensors, Qwen3.5 names; the
    decoder layer is a Qwen3 layer, as transformers' `MtpModel` builds it for a Qwen3 target)."""
    from dmtp_jax.checkpoint.hf import load_target, save_target
    from dmtp_jax.checkpoint.mtp_ckpt import init_mtp, mtp_tensors

    d = str(tmp_path_factory.mktemp("mtp") / "target")
    target = load_target(peaked_target_dir)
    mtp = init_mtp(target.cfg, seed=11)
    import jax
    # spread the random head's weights so its first-candidate guesses are varied, not constant
    mtp.state = jax.tree.map(lambda x: x * 4.0 if x.ndim == 2 else x, mtp.state)
    save_target(target, d, extra_tensors=mtp_tensors(mtp))
    return d
