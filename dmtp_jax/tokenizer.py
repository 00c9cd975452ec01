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
    (`tok(text).input_ids`, `decode`, `eos_token_id`, `apply_chat_template` of a `chat_template.jinja`
    rendered as transformers renders it); it loads in milliseconds, without importing transformers and torch."""

    def __init__(self, tokenizer, config: dict, chat_template: str | None = None):
        self._tok, self.chat_template, self._template = tokenizer, chat_template, None
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

    def apply_chat_template(self, messages, tools=None, add_generation_prompt: bool = False, tokenize: bool = True,
                            **kwargs):
        """transformers' `apply_chat_template` (its Jinja environment: trimmed blocks, `tojson`,
        `raise_exception`); the token ids, or the text with `tokenize=False`."""
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template")
        if self._template is None:
            self._template = compile_chat_template(self.chat_template)
        text = self._template.render(messages=messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                     bos_token=self.bos_token, eos_token=self.eos_token, **kwargs)
        return self(text, add_special_tokens=False).input_ids if tokenize else text

    def __len__(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def get_vocab(self) -> dict[str, int]:
        return self._tok.get_vocab(with_added_tokens=True)


class _Encoding(dict):
    """`{"input_ids": ids}` that also answers `.input_ids`."""

    def __init__(self, ids):
        super().__init__(input_ids=ids)
        self.input_ids = ids


def compile_chat_template(source: str):
    """A chat template compiled in transformers' Jinja environment (`ImmutableSandboxedEnvironment`,
    `trim_blocks`, `lstrip_blocks`, loop controls, its `tojson` and `raise_exception`).

    Example:
        >>> compile_chat_template("{{ messages[0] | tojson }}").render(messages=[{"a": "é"}])
        '{"a": "é"}'
    """
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    return env.from_string(source)


def plain_tokenizer(model_dir: str) -> PlainTokenizer | None:
    """A `PlainTokenizer` when the directory's tokenizer is exactly its `tokenizer.json` (with at most a
    `chat_template.jinja`, no extra options), else None."""
    path, cfg_path = os.path.join(model_dir, "tokenizer.json"), os.path.join(model_dir, "tokenizer_config.json")
    if not os.path.isfile(path):
        return None
    template_path, template = os.path.join(model_dir, "chat_template.jinja"), None
    if os.path.isfile(template_path):
        with open(template_path) as fh:
            template = fh.read()
    config = {}
    if os.path.isfile(cfg_path):
        with open(cfg_path) as fh:
            config = json.load(fh)
    if set(config) - _PLAIN_KEYS or config.get("tokenizer_class", "PreTrainedTokenizerFast") not in _PLAIN_CLASSES:
        return None
    if any(os.path.isfile(os.path.join(model_dir, f)) for f in ("special_tokens_map.json", "added_tokens.json")):
        return None
    try:
        return PlainTokenizer(Tokenizer.from_file(path), config, template)
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
