"""Shared pytest fixtures: tiny random HF checkpoints built with transformers + torch (no download).

Fixtures (session-scoped, built once per test run into a pytest tmp dir):

* ``tiny_qwen3_dir``     -- a ``Qwen3ForCausalLM`` directory (``config.json``, ``model.safetensors``
  in fp32, ``generation_config.json``); no tokenizer.
* ``tiny_qwen3_moe_dir`` -- a ``Qwen3MoeForCausalLM`` directory, every layer sparse (4 experts, top-2,
  ``norm_topk_prob=True``, ``moe_intermediate_size`` 16).

* ``tiny_qwen3_5_dir`` / ``tiny_qwen3_5_moe_dir`` -- hybrid ``Qwen3_5ForCausalLM`` /
  ``Qwen3_5MoeForCausalLM`` directories (``build_tiny_checkpoint(d, "qwen3_next")`` makes the
  Qwen3-Next variant: fused DeltaNet projections, layer 1 dense) (4 layers: 3 Gated DeltaNet + 1 gated attention; partial
  rotary 0.25 of head_dim 16; DeltaNet 2 key / 4 value heads of 8; MoE: 4 experts, top-2, a shared
  expert of 24) carrying a random native MTP head (``mtp.*``: a donor full-attention layer, fc and
  four norms), every zero-centred norm weight drawn from N(0, 0.3) (the gated DeltaNet norm, a plain
  weight, from U(0.5, 1.5)) and a few LM-head rows scaled up (``BOOSTED_ROWS``) so that drafters
  sharing the head are partly accepted.

Qwen3 fixtures: vocab 128, hidden 32, 2 layers, 4 heads, 2 KV heads, head_dim 8, max_position_embeddings 512,
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

import os
import shutil
import tempfile

import pytest

# Tests never write into the user's home: auto's verdicts and everything else under $DMTP_JAX_CACHE go
# to a fresh directory per run, made by the first process (pytest-xdist's workers and every subprocess
# inherit it). JAX's persistent compilation cache lives there too, on for every compile of the run
# (in-process, xdist workers and CLI subprocesses alike): the many tests that build the same tiny
# models compile each program once per run instead of once per module and process.
_OWN_CACHE = "DMTP_JAX_CACHE" not in os.environ          # made here: removed when the run ends
os.environ.setdefault("DMTP_JAX_CACHE", tempfile.mkdtemp(prefix="dmtp-jax-test-cache-"))
os.environ["DMTP_JAX_COMPILE_CACHE"] = os.path.join(os.environ["DMTP_JAX_CACHE"], "jax-cache")
os.environ["JAX_COMPILATION_CACHE_DIR"] = os.environ["DMTP_JAX_COMPILE_CACHE"]
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
# The tests' programs are tiny and run for microseconds: compiling dominates, and LLVM at -O0 without
# its expensive passes compiles ~1.6x faster on CPU. XLA's HLO passes (fusion, SPMD partitioning) all
# still run; the run's every program, reference and speculative alike, is compiled the same way.
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
                               " --xla_llvm_disable_expensive_passes=true").strip()


def pytest_unconfigure(config):
    """The run's cache directory goes with the process that made it (xdist workers only inherit it)."""
    if _OWN_CACHE and not hasattr(config, "workerinput"):
        shutil.rmtree(os.environ["DMTP_JAX_CACHE"], ignore_errors=True)


# `--doctest-modules` (pyproject's addopts) is for `dmtp_jax/`: the helper modules here are imported
# by the tests, never collected (sharded_forward_check.py sets XLA_FLAGS before importing jax).
collect_ignore = ["sharded_forward_check.py", "dflash_fixtures.py", "stat_checks.py", "train_fixtures.py",
                  "workload_fixtures.py", "gemma_fixtures.py", "mla_fixtures.py", "serve_fixtures.py"]

TINY_COMMON = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                   max_position_embeddings=512, rms_norm_eps=1e-6, initializer_range=0.1,
                   eos_token_id=127, bos_token_id=None, pad_token_id=None)
TINY_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True,
                decoder_sparse_step=1, mlp_only_layers=[])


TINY_HYBRID = dict(vocab_size=128, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                   linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
                   max_position_embeddings=512, rms_norm_eps=1e-6, initializer_range=0.1,
                   eos_token_id=127, bos_token_id=None, pad_token_id=None, tie_word_embeddings=False,
                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                    "partial_rotary_factor": 0.25})
TINY_HYBRID_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                       shared_expert_intermediate_size=24)
HYBRID_FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")


def _build_hybrid(family: str, out_dir: str, overrides: dict):
    """A tiny Qwen3.5 / Qwen3.5-MoE model saved with a random `mtp.*` head next to its tensors."""
    import os

    import torch
    from safetensors.torch import load_file, save_file
    from transformers import (Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig,
                              Qwen3_5TextConfig, Qwen3NextConfig, Qwen3NextForCausalLM)

    if family == "qwen3_5":
        cfg, cls = Qwen3_5TextConfig(**{**TINY_HYBRID, "intermediate_size": 64, **overrides}), Qwen3_5ForCausalLM
    elif family == "qwen3_next":    # fused per-key-head DeltaNet projections; layer 1 dense
        cfg = Qwen3NextConfig(**{**TINY_HYBRID, **TINY_HYBRID_MOE, "intermediate_size": 64,
                                 "mlp_only_layers": [1], "norm_topk_prob": True, **overrides})
        cls = Qwen3NextForCausalLM
    else:
        cfg, cls = Qwen3_5MoeTextConfig(**{**TINY_HYBRID, **TINY_HYBRID_MOE, **overrides}), Qwen3_5MoeForCausalLM
    model, donor = cls(cfg), cls(cfg)
    full = cfg.layer_types.index("full_attention")
    h = cfg.hidden_size
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(donor.named_parameters()):
            if name.endswith("linear_attn.norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith("norm.weight"):
                p.normal_(0.0, 0.3)
        model.lm_head.weight[list(BOOSTED_ROWS)] *= 6.0
        mtp = {f"mtp.layers.0.{k}": v.clone() for k, v in donor.model.layers[full].state_dict().items()}
        mtp["mtp.fc.weight"] = torch.randn(h, 2 * h) * 4.0 / (2 * h) ** 0.5
        for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
            mtp[f"mtp.{norm}.weight"] = 0.3 * torch.randn(h)
    model.save_pretrained(out_dir)
    path = os.path.join(out_dir, "model.safetensors")
    tensors = load_file(path)
    tensors.update({k: v.contiguous() for k, v in mtp.items()})
    save_file(tensors, path, metadata={"format": "pt"})
    return model


def build_tiny_checkpoint(out_dir: str, family: str = "qwen3", seed: int = 0, **overrides) -> str:
    """Writes a tiny random HF checkpoint of `family` ("qwen3", "qwen3_moe", "qwen3_5",
    "qwen3_5_moe") to `out_dir`; `overrides` replace config fields (e.g. `tie_word_embeddings=True`,
    `num_hidden_layers=3`).

    Example:
        >>> build_tiny_checkpoint("/tmp/tiny-moe", "qwen3_moe")  # doctest: +SKIP
        '/tmp/tiny-moe'
    """
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    if family in HYBRID_FAMILIES:
        _build_hybrid(family, out_dir, overrides)
        return out_dir
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


@pytest.fixture(scope="session")
def tiny_qwen3_5_dir(tmp_path_factory) -> str:
    """A tiny hybrid Qwen3.5 (dense) checkpoint with `mtp.*` (see module docstring). Read-only."""
    return build_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny-qwen3_5")), "qwen3_5", seed=4)


@pytest.fixture(scope="session")
def tiny_qwen3_5_moe_dir(tmp_path_factory) -> str:
    """A tiny hybrid Qwen3.5-MoE checkpoint with `mtp.*` (see module docstring). Read-only."""
    return build_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny-qwen3_5_moe")), "qwen3_5_moe", seed=5)


def to_image_text_layout(src_dir: str, out_dir: str) -> str:
    """The released image-text layout of a text-only hybrid checkpoint: `model.language_model.*`,
    a `model.visual.*` tensor, experts fused (`experts.gate_up_proj` / `experts.down_proj`, MTP
    included), tensors split over two shards with an index, config nested in `text_config`."""
    import json
    import os
    import re

    import numpy as np

    from dmtp_jax.checkpoint.safetensors_io import CheckpointReader, write_sharded

    reader = CheckpointReader(src_dir)
    flat = {k: np.array(reader.array(k)) for k in reader.keys()}
    out, experts = {}, {}
    for name, value in flat.items():
        m = re.fullmatch(r"(.*mlp\.experts\.)(\d+)\.(gate|up|down)_proj\.weight", name)
        if m:
            experts.setdefault(m.group(1), {}).setdefault(m.group(3), {})[int(m.group(2))] = value
            continue
        out[name.replace("model.", "model.language_model.", 1) if name.startswith("model.") else name] = value
    for base, parts in experts.items():
        stack = {which: np.stack([parts[which][e] for e in sorted(parts[which])]) for which in parts}
        base = base.replace("model.", "model.language_model.", 1) if base.startswith("model.") else base
        out[base + "gate_up_proj"] = np.concatenate([stack["gate"], stack["up"]], axis=1)
        out[base + "down_proj"] = stack["down"]
    out["model.visual.patch_embed.proj.weight"] = np.zeros((4, 3), np.float32)
    os.makedirs(out_dir, exist_ok=True)
    write_sharded(out_dir, out, max_shard_bytes=sum(v.nbytes for v in out.values()) // 2)
    with open(os.path.join(src_dir, "config.json")) as fh:
        text = json.load(fh)
    vlm_type = text["model_type"].replace("_text", "")
    with open(os.path.join(out_dir, "config.json"), "w") as fh:
        json.dump({"model_type": vlm_type, "architectures": ["ImageTextModel"], "text_config": text,
                   "vision_config": {"depth": 1}, "tie_word_embeddings": text["tie_word_embeddings"]}, fh)
    return out_dir


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
