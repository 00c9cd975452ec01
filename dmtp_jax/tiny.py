"""A tiny random Qwen3 checkpoint with a byte-level tokenizer, built on the fly (no download):
`infer.py`'s default target, random weights but every real code path."""

from __future__ import annotations

import json
import os
import shutil

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from dmtp_jax.checkpoint.hf import init_target, save_target
from dmtp_jax.config import TargetConfig
from dmtp_jax.paths import cache_root

EOS_TOKEN = "<|endoftext|>"


def tiny_target_config(vocab_size: int = 320, eos_id: int = 256) -> TargetConfig:
    return TargetConfig.from_hf_dict({
        "model_type": "qwen3", "vocab_size": vocab_size, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "max_position_embeddings": 2048, "eos_token_id": eos_id, "tie_word_embeddings": False,
        "rope_theta": 10000.0,
    })


def save_byte_tokenizer(out_dir: str) -> int:
    """Writes a byte-level tokenizer (256 byte tokens + `<|endoftext|>`) that AutoTokenizer loads;
    returns the EOS id."""
    from transformers import PreTrainedTokenizerFast   # lazy: imports torch (seconds); only on the first build

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOS_TOKEN])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=EOS_TOKEN)
    fast.save_pretrained(out_dir)
    return fast.convert_tokens_to_ids(EOS_TOKEN)


def default_tiny_dir() -> str:
    """`$DMTP_JAX_CACHE/tiny-qwen3` (default cache: `~/.cache/dmtp-jax`)."""
    return os.path.join(cache_root(), "tiny-qwen3")


def ensure_tiny_target(out_dir: str | None = None, seed: int = 0) -> str:
    """Builds the tiny checkpoint once (config.json, model.safetensors, tokenizer) and returns its path."""
    out_dir = out_dir or default_tiny_dir()
    if os.path.isfile(os.path.join(out_dir, "model.safetensors")):
        return out_dir

    tmp = out_dir + ".partial"
    os.makedirs(tmp, exist_ok=True)
    eos = save_byte_tokenizer(tmp)
    target = init_target(tiny_target_config(eos_id=eos), "float32", seed=seed)
    save_target(target, tmp)
    with open(os.path.join(tmp, "generation_config.json"), "w") as fh:
        json.dump({"eos_token_id": eos, "do_sample": False}, fh)
    os.makedirs(os.path.dirname(out_dir) or ".", exist_ok=True)
    if os.path.isdir(out_dir):
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)
    return out_dir
