"""HF checkpoint interop: load, save back, sharded index, dtype, and one clear error per failure."""

import json
import os
import shutil

import numpy as np
import pytest
import torch

from dmtp_jax.checkpoint.hf import load_target, save_target
from dmtp_jax.checkpoint.safetensors_io import CheckpointError, CheckpointReader, write_safetensors
from dmtp_jax.config import ConfigError
from dmtp_jax.decode.batch import RequestError, pad_prompts

IDS = np.array([[3, 17, 42, 99, 7, 64, 1, 120, 5]])


def hf_logits(model_dir):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor(IDS)).logits.numpy()


def jax_logits(target):
    import jax.numpy as jnp
    from flax import nnx
    model = nnx.merge(target.graphdef, target.state)
    out = model(jnp.asarray(IDS), jnp.arange(IDS.shape[1])[None])
    return np.asarray(model.logits(out.hidden_bth), np.float32)


def copy_dir(src, dst):
    shutil.copytree(src, dst)
    return str(dst)


@pytest.mark.parametrize("fixture", ["tiny_qwen3_dir", "tiny_qwen3_moe_dir"])
def test_save_roundtrip_loads_in_transformers(fixture, request, tmp_path):
    src = request.getfixturevalue(fixture)
    target = load_target(src)
    save_target(target, str(tmp_path / "out"), max_shard_bytes=20_000)   # forces several shards
    assert os.path.isfile(tmp_path / "out" / "model.safetensors.index.json")
    np.testing.assert_allclose(hf_logits(str(tmp_path / "out")), hf_logits(src), atol=1e-6, rtol=0)
    np.testing.assert_allclose(jax_logits(load_target(str(tmp_path / "out"))), jax_logits(target),
                               atol=0, rtol=0)


def test_bfloat16_load_matches_fp32_within_bf16(tiny_qwen3_dir):
    f32 = jax_logits(load_target(tiny_qwen3_dir, "float32"))
    b16 = load_target(tiny_qwen3_dir, "bfloat16")
    assert str(b16.state_dtype) == "bfloat16"
    assert np.abs(jax_logits(b16) - f32).max() < 0.1 * np.abs(f32).max()


def test_tied_embeddings_roundtrip(tmp_path):
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(1)
    cfg = Qwen3Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=8, tie_word_embeddings=True)
    Qwen3ForCausalLM(cfg).save_pretrained(tmp_path / "tied")
    target = load_target(str(tmp_path / "tied"))
    assert "lm_head" not in dict(target.state)
    model_ids = IDS % 64
    from transformers import AutoModelForCausalLM
    ref = AutoModelForCausalLM.from_pretrained(tmp_path / "tied").eval()
    with torch.no_grad():
        want = ref(torch.tensor(model_ids)).logits.numpy()
    import jax.numpy as jnp
    from flax import nnx
    model = nnx.merge(target.graphdef, target.state)
    got = model.logits(model(jnp.asarray(model_ids), jnp.arange(model_ids.shape[1])[None]).hidden_bth)
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-4, rtol=0)


def rewrite(model_dir, edit):
    """Rewrites model.safetensors with `edit(dict_of_arrays)` applied."""
    reader = CheckpointReader(model_dir)
    tensors = {k: np.array(reader.array(k)) for k in reader.keys()}
    edit(tensors)
    del reader
    write_safetensors(os.path.join(model_dir, "model.safetensors"), tensors)


def test_missing_tensor_is_named(tiny_qwen3_dir, tmp_path):
    d = copy_dir(tiny_qwen3_dir, tmp_path / "m")
    rewrite(d, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor 'model\.layers\.1\.self_attn\.k_proj\.weight'"):
        load_target(d)


def test_shape_mismatch_is_named(tiny_qwen3_dir, tmp_path):
    d = copy_dir(tiny_qwen3_dir, tmp_path / "m")
    rewrite(d, lambda t: t.update({"model.norm.weight": np.ones(7, np.float32)}))
    with pytest.raises(CheckpointError, match=r"'model\.norm\.weight' has shape \[7\], expected \[32\]"):
        load_target(d)


def test_unexpected_tensor_is_named_but_mtp_is_allowed(tiny_qwen3_dir, tmp_path):
    d = copy_dir(tiny_qwen3_dir, tmp_path / "m")
    rewrite(d, lambda t: t.update({"mtp.fc.weight": np.ones((2, 2), np.float32)}))
    load_target(d)
    rewrite(d, lambda t: t.update({"model.extra.weight": np.ones(2, np.float32)}))
    with pytest.raises(CheckpointError, match=r"unexpected tensors .*model\.extra\.weight"):
        load_target(d)


def test_unknown_model_type_and_bad_files(tiny_qwen3_dir, tmp_path):
    d = copy_dir(tiny_qwen3_dir, tmp_path / "m")
    cfg = json.load(open(os.path.join(d, "config.json")))
    json.dump({**cfg, "model_type": "llama"}, open(os.path.join(d, "config.json"), "w"))
    with pytest.raises(ConfigError, match="unknown model_type 'llama'"):
        load_target(d)
    json.dump(cfg, open(os.path.join(d, "config.json"), "w"))
    with open(os.path.join(d, "model.safetensors"), "r+b") as fh:
        fh.truncate(1000)
    with pytest.raises(CheckpointError, match="truncated|runs past the end|cannot read"):
        load_target(d)
    os.remove(os.path.join(d, "model.safetensors"))
    with pytest.raises(CheckpointError, match="no safetensors weights"):
        load_target(d)
    with pytest.raises(ConfigError, match="not found"):
        load_target(str(tmp_path / "nope"))
    open(os.path.join(d, "config.json"), "w").write("{not json")
    with pytest.raises(ConfigError, match="cannot read"):
        load_target(d)


def test_sharded_index_with_missing_shard(tiny_qwen3_dir, tmp_path):
    target = load_target(tiny_qwen3_dir)
    out = str(tmp_path / "sharded")
    save_target(target, out, max_shard_bytes=20_000)
    index = json.load(open(os.path.join(out, "model.safetensors.index.json")))
    victim = sorted(set(index["weight_map"].values()))[-1]
    os.remove(os.path.join(out, victim))
    with pytest.raises(CheckpointError, match=f"shard '{victim}'"):
        load_target(out)


def test_request_validation():
    with pytest.raises(RequestError, match="empty"):
        pad_prompts([[1], []], 4, 10)
    with pytest.raises(RequestError, match="outside the vocabulary"):
        pad_prompts([[1, 12]], 4, 10)
    with pytest.raises(RequestError, match="max_position_embeddings"):
        pad_prompts([[1] * 10], 8, 100, max_positions=16)


BASE_STACK = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 30,
              "num_attention_heads": 4, "num_key_value_heads": 2}
# keys a config may leave out: each set against transformers' own parse of the same dict
STACK_VARIANTS = [{}, {"use_sliding_window": True}, {"use_sliding_window": True, "sliding_window": 16},
                  {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 4},
                  {"sliding_window": 16, "max_window_layers": 4}, {"head_dim": 8},
                  {"use_sliding_window": True, "sliding_window": 16,
                   "layer_types": ["sliding_attention", "full_attention"] * 15}]


@pytest.mark.parametrize("variant", STACK_VARIANTS, ids=lambda v: ",".join(v) or "bare")
@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_moe", "qwen3_next", "drafter"])
def test_stack_fields_follow_transformers(model_type, variant):
    """Targets and DFlash drafters read head_dim, the window and the per-layer attention types by
    one rule (`hf_config.py`): the one transformers' config class of the family applies."""
    import transformers
    from dmtp_jax.config import TargetConfig
    from dmtp_jax.models.dflash_config import DFlashConfig

    d = {**BASE_STACK, **variant}
    hf_cls = {"qwen3": transformers.Qwen3Config, "qwen3_moe": transformers.Qwen3MoeConfig,
              "qwen3_next": transformers.Qwen3NextConfig, "drafter": transformers.Qwen3Config}[model_type]
    if model_type in ("qwen3_moe", "qwen3_next"):
        d = {**d, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16}
    hf = hf_cls(**d)
    hf_types = tuple(getattr(hf, "layer_types", None) or ["sliding_attention" if hf.sliding_window is not None
                                                         else "full_attention"] * hf.num_hidden_layers)
    if model_type == "qwen3_moe" and "layer_types" in variant:     # not a Qwen3-MoE key: we refuse it
        with pytest.raises(ConfigError, match="every layer or none"):
            TargetConfig.from_hf_dict({**d, "model_type": model_type})
        return
    if model_type == "drafter":
        ours = DFlashConfig.from_hf_dict({**d, "architectures": ["DFlashDraftModel"], "mask_token_id": 3,
                                          "target_layer_ids": [0]})
    else:
        ours = TargetConfig.from_hf_dict({**d, "model_type": model_type})
    hf_head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    assert (ours.layer_types, ours.head_dim) == (hf_types, hf_head_dim)
    if model_type != "qwen3_next":          # a stray key there: Qwen3-Next's attention has no window
        assert ours.sliding_window == hf.sliding_window
