"""How often each vocabulary id is a supervised token of a training set: the counts behind the
efficient drafting head's frequency subset (`models/draft_head.py:frequent_ids`). Records are
encoded as training encodes them; malformed ones are skipped with a warning.

Example:
    >>> from dmtp_jax.train.data import TokenDataset
    >>> count_tokens(TokenDataset.from_records([{"input_ids": [1, 2, 2], "loss_mask": [0, 1, 1]}], 4), 4).tolist()
    [0, 0, 2, 0]
"""

from __future__ import annotations

import os

import numpy as np
from tqdm.auto import tqdm

from dmtp_jax.checkpoint.draft_head_ckpt import TOKEN_COUNTS
from dmtp_jax.config import load_target_config
from dmtp_jax.errors import InputError
from dmtp_jax.tokenizer import load_tokenizer
from dmtp_jax.train.data import TokenDataset


def count_tokens(dataset, vocab: int, progress: bool = False) -> np.ndarray:
    """`int64 [vocab]`: how often each id is a loss-masked token of `dataset`'s rows."""
    counts = np.zeros(vocab, np.int64)
    for index in tqdm(range(len(dataset)), disable=not progress, unit="rec", desc="counting tokens"):
        tokens, mask, malformed = dataset.encode(index)
        if not malformed:
            counts += np.bincount(tokens[mask > 0], minlength=vocab)[:vocab]
    return counts


def write_token_counts(target: str, data: str, out: str, seq_len: int = 4096, progress: bool = True) -> dict:
    """Counts the supervised tokens of `data` with `target`'s tokenizer and writes them atomically to
    `out` (a directory: `out/token_counts.npy`; else the file); returns a summary."""
    if seq_len < 1:
        raise InputError(f"--seq-len must be >= 1, got {seq_len}")
    vocab = load_target_config(target).vocab_size
    dataset = TokenDataset.from_file(data, seq_len, load_tokenizer(target), vocab)
    counts = count_tokens(dataset, vocab, progress)
    path = os.path.join(out, TOKEN_COUNTS) if os.path.isdir(out) or not out.endswith(".npy") else out
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp.npy"
    np.save(tmp, counts)
    os.replace(tmp, path)
    order = np.sort(counts)[::-1]
    covered = {n: round(float(order[:n].sum() / max(1, counts.sum())), 4) for n in (1024, 4096, 32768) if n < vocab}
    return {"path": path, "records": len(dataset), "malformed": dataset.malformed, "tokens": int(counts.sum()),
            "distinct": int((counts > 0).sum()), "coverage_of_top": covered}
