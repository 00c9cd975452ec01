"""Tokenizer and stop tokens of a checkpoint directory (transformers AutoTokenizer when present)."""

from __future__ import annotations

import json
import os


def load_tokenizer(model_dir: str):
    """The directory's tokenizer, or None when it ships none (use token ids then)."""
    if not any(os.path.isfile(os.path.join(model_dir, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(model_dir)


def stop_token_ids(model_dir: str, config_eos: tuple[int, ...], tokenizer=None) -> list[int]:
    """EOS ids from config.json, generation_config.json and the tokenizer, deduplicated."""
    ids = list(config_eos)
    path = os.path.join(model_dir, "generation_config.json")
    if os.path.isfile(path):
        with open(path) as fh:
            eos = json.load(fh).get("eos_token_id")
        ids += eos if isinstance(eos, list) else ([eos] if eos is not None else [])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return sorted(set(int(i) for i in ids))
