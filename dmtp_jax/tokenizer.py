"""Tokenizer and stop tokens of a checkpoint directory (transformers AutoTokenizer when present)."""

from __future__ import annotations

import json
import os

from tokenizers import Tokenizer

# tokenizer_config.json keys that change nothing `tokenizer.json` does not already say
_PLAIN_KEYS = {"backend", "tokenizer_class", "model_max_length", "eos_token", "pad_token", "mask_token",
               "bos_token", "unk_token", "clean_up_tokenization_spaces", "added_tokens_decoder"}
_PLAIN_CLASSES = {"TokenizersBackend", "PreTrainedTokenizerFast"}


class PlainTokenizer:
    """A `tokenizers.Tokenizer` with the part of transformers' tokenizer interface the inference CLI uses
    (`tok(text).input_ids`, `decode`, `eos_token_id`, no chat template); it loads in milliseconds,
    without importing transformers and torch."""

    chat_template = None

    def __init__(self, tokenizer, config: dict):
        self._tok = tokenizer
        self.clean_up = bool(config.get("clean_up_tokenization_spaces", False))
        for name in ("eos", "pad", "mask", "bos", "unk"):
            token = config.get(f"{name}_token")
            token = token.get("content") if isinstance(token, dict) else token
            setattr(self, f"{name}_token", token)
            setattr(self, f"{name}_token_id", None if token is None else tokenizer.token_to_id(token))

    def __call__(self, text: str, add_special_tokens: bool = True):
        return _Encoding(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        text = self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)
        if self.clean_up:               # transformers' clean_up_tokenization
            for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                         (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
                text = text.replace(a, b)
        return text

    def __len__(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def get_vocab(self) -> dict[str, int]:
        return self._tok.get_vocab(with_added_tokens=True)


class _Encoding(dict):
    """`{"input_ids": ids}` that also answers `.input_ids`."""

    def __init__(self, ids):
        super().__init__(input_ids=ids)
        self.input_ids = ids


def plain_tokenizer(model_dir: str) -> PlainTokenizer | None:
    """A `PlainTokenizer` when the directory's tokenizer is exactly its `tokenizer.json` (no chat
    template, no extra options), else None."""
    path, cfg_path = os.path.join(model_dir, "tokenizer.json"), os.path.join(model_dir, "tokenizer_config.json")
    if not os.path.isfile(path) or os.path.isfile(os.path.join(model_dir, "chat_template.jinja")):
        return None
    config = {}
    if os.path.isfile(cfg_path):
        with open(cfg_path) as fh:
            config = json.load(fh)
    if set(config) - _PLAIN_KEYS or config.get("tokenizer_class", "PreTrainedTokenizerFast") not in _PLAIN_CLASSES:
        return None
    if any(os.path.isfile(os.path.join(model_dir, f)) for f in ("special_tokens_map.json", "added_tokens.json")):
        return None
    try:
        return PlainTokenizer(Tokenizer.from_file(path), config)
    except Exception:                   # anything unusual: transformers knows best
        return None


def load_tokenizer(model_dir: str, plain: bool = False):
    """The directory's tokenizer, or None when it ships none. `plain`: a `PlainTokenizer` where exact,
    else transformers' AutoTokenizer."""
    if not any(os.path.isfile(os.path.join(model_dir, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    if plain:
        tok = plain_tokenizer(model_dir)
        if tok is not None:
            return tok
    from transformers import AutoTokenizer     # lazy: imports torch (seconds); the plain path skips it
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
