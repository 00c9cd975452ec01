"""Training data: records -> fixed-length token rows with a loss mask -> global batches (grain).

Records (`.jsonl`, `.json` list, `.parquet`): `{"input_ids", "loss_mask"?}` as is;
`{"messages"}` through the target's chat template (assistant turns supervised); `{"text"}` (every
token supervised). Each record becomes one row of `seq_len` tokens (truncated, right-padded with
`pad_id`, mask 0): padding, not packing. A malformed record is counted once and replaced by an
all-padding row (never fatal, never shifts other records); a file with no valid record is a
`DataError`. Every JAX process runs the same shuffled index pipeline and encodes only the rows
its devices hold; the iterator state is grain's, JSON-serialisable.

Example:
    >>> ds = TokenDataset.from_records([{"input_ids": [1, 2, 3]}], seq_len=4)
    >>> ds.encode(0)
    (array([1, 2, 3, 0], dtype=int32), array([1, 1, 1, 0], dtype=int32), False)
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import logging
import os
from typing import Any, Sequence

import numpy as np

from dmtp_jax.errors import DataError

log = logging.getLogger(__name__)
RECORD_LAYOUTS = ('{"input_ids": [...], "loss_mask": [...]}, {"messages": [{"role": ..., "content": ...}]} '
                  'or {"text": "..."}, one JSON object per line')
MAX_WARNINGS = 20


class MalformedRecord(ValueError):
    """A record that cannot be turned into tokens (skipped, never fatal)."""


def read_records(path: str) -> list[Any]:
    """Raw records of a data file (training data and benchmark workloads): a JSON-lines file (`.gz` or
    not) gives its non-blank lines unparsed; a `.json` list its items; a `.parquet` file its rows as
    dicts. A missing or empty file or a broken JSON list is a `DataError`."""
    if not os.path.isfile(path):
        raise DataError(f"data file not found: {path}")
    if path.endswith(".parquet"):
        try:
            import pyarrow.parquet as pq     # optional: only .parquet files need it
        except ImportError:
            raise DataError(f"{path}: reading parquet needs pyarrow (pip install pyarrow)") from None
        return pq.read_table(path).to_pylist()
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8", errors="replace") as fh:
        text = fh.read()
    if text.lstrip().startswith("["):
        try:
            records = json.loads(text)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}: not a valid JSON list ({e.msg} at line {e.lineno})") from None
    else:
        records = [line for line in text.splitlines() if line.strip()]
    if not records:
        raise DataError(f"data file {path} has no records")
    return records


def parse_record(raw: Any) -> dict:
    """A record as a dict (JSON lines are parsed here); raises `MalformedRecord`."""
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as e:
            raise MalformedRecord(f"bad JSON ({e.msg})") from None
    if not isinstance(raw, dict):
        raise MalformedRecord(f"a record must be an object, got {type(raw).__name__}")
    return raw


def render_chat(tokenizer, messages, generation_prompt: bool) -> str:
    """`messages` through the tokenizer's chat template; a `MalformedRecord` (one line, never a
    traceback) when it has none or the template refuses them."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise MalformedRecord("'messages' records need a target whose tokenizer has a chat template "
                              "(give 'input_ids' or 'text' records)")
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    except Exception as e:      # noqa: BLE001 -- the template's own complaint about these messages
        raise MalformedRecord(f"the chat template failed: {e}") from None


def _segments_for_messages(messages, tokenizer) -> list[tuple[str, int]]:
    """(text, supervised) segments of a rendered conversation, assistant turns supervised; when a
    template rewrites earlier turns, only the final assistant turn is."""
    def render(msgs, gen):
        return render_chat(tokenizer, msgs, gen)

    full = render(messages, False)
    segments, done = [], ""
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before, after = render(messages[:i], True), render(messages[:i + 1], False)
        if not (before.startswith(done) and after.startswith(before) and full.startswith(after)):
            last = max(j for j, mm in enumerate(messages) if mm["role"] == "assistant")
            before = render(messages[:last], True)
            if not full.startswith(before):
                raise MalformedRecord("the chat template does not render a prefix of the conversation")
            return [(before, 0), (full[len(before):], 1)]
        segments += [(before[len(done):], 0), (after[len(before):], 1)]
        done = after
    segments.append((full[len(done):], 0))
    return [(t, s) for t, s in segments if t]


def encode_messages(messages, tokenizer) -> tuple[list[int], list[int]]:
    """Token ids and loss mask (1 on assistant turns) of a conversation with the chat template."""
    if not isinstance(messages, list) or not messages:
        raise MalformedRecord("'messages' must be a non-empty list")
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise MalformedRecord("each message needs string 'role' and 'content'")
    if not any(m["role"] == "assistant" for m in messages):
        raise MalformedRecord("no assistant turn to supervise")
    ids, mask = [], []
    for text, supervised in _segments_for_messages(messages, tokenizer):
        part = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids += part
        mask += [supervised] * len(part)
    return ids, mask


def encode_record(record: dict, tokenizer=None, vocab_size: int | None = None) -> tuple[list[int], list[int]]:
    """(token ids, loss mask) of one parsed record; raises `MalformedRecord`.

    Example:
        >>> encode_record({"input_ids": [4, 5], "loss_mask": [0, 1]})
        ([4, 5], [0, 1])
    """
    if "input_ids" in record:
        ids = record["input_ids"]
        mask = record.get("loss_mask", [1] * len(ids) if isinstance(ids, list) else None)
        if not isinstance(ids, list) or not isinstance(mask, list):
            raise MalformedRecord("'input_ids' and 'loss_mask' must be lists")
        if len(ids) != len(mask):
            raise MalformedRecord(f"'input_ids' ({len(ids)}) and 'loss_mask' ({len(mask)}) differ in length")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise MalformedRecord("'input_ids' must be integers")
        if not all(m in (0, 1, True, False) for m in mask):
            raise MalformedRecord("'loss_mask' must be 0/1")
        out = list(ids), [int(m) for m in mask]
    elif "messages" in record or "text" in record:
        if tokenizer is None:
            raise MalformedRecord("'messages' / 'text' records need a target with a tokenizer")
        if "messages" in record:
            out = encode_messages(record["messages"], tokenizer)
        else:
            if not isinstance(record["text"], str):
                raise MalformedRecord("'text' must be a string")
            ids = tokenizer(record["text"], add_special_tokens=False)["input_ids"]
            out = list(ids), [1] * len(ids)
    else:
        raise MalformedRecord(f"unknown record layout (keys {sorted(record)[:5]}); expected "
                              "'input_ids', 'messages' or 'text'")
    if not out[0]:
        raise MalformedRecord("the record has no tokens")
    if vocab_size is not None and not all(0 <= t < vocab_size for t in out[0]):
        raise MalformedRecord(f"token ids outside the vocabulary [0, {vocab_size})")
    return out


def token_stream(records, eos_id: int, tokenizer=None, vocab_size: int | None = None,
                 seq_len: int | None = None) -> np.ndarray:
    """Every valid record encoded as training encodes it, cut to `seq_len` when given and followed by
    `eos_id`, as one int32 stream (random-window batches).

    Example:
        >>> token_stream([{"input_ids": [5, 6, 8]}, "bad", {"input_ids": [7]}], 0, seq_len=2).tolist()
        [5, 6, 0, 7, 0]
    """
    ids: list[int] = []
    for raw in records:
        try:
            tokens, _ = encode_record(parse_record(raw), tokenizer, vocab_size)
        except MalformedRecord:
            continue
        ids.extend([*tokens[:seq_len], eos_id])
    return np.asarray(ids, np.int32)


def pad_row(ids: Sequence[int], mask: Sequence[int], seq_len: int, pad_id: int = 0):
    """Truncates / right-pads to `seq_len`: `(tokens_l int32, loss_mask_l int32)`."""
    tokens = np.full((seq_len,), pad_id, np.int32)
    loss_mask = np.zeros((seq_len,), np.int32)
    n = min(len(ids), seq_len)
    tokens[:n] = np.asarray(ids[:n], np.int32)
    loss_mask[:n] = np.asarray(mask[:n], np.int32)
    return tokens, loss_mask


@dataclasses.dataclass
class TokenDataset:
    """Random access to encoded rows: `encode(i) -> (tokens_l, loss_mask_l, malformed)`; `malformed`
    counts distinct malformed records met by this process."""

    records: list[Any]
    seq_len: int
    tokenizer: Any = None
    vocab_size: int | None = None
    pad_id: int = 0
    source: str = "records"
    _bad: set = dataclasses.field(default_factory=set)
    _warned: int = 0

    @classmethod
    def from_records(cls, records, seq_len: int, **kw) -> "TokenDataset":
        return cls(list(records), seq_len, **kw)

    @classmethod
    def from_file(cls, path: str, seq_len: int, tokenizer=None, vocab_size=None) -> "TokenDataset":
        pad = 0
        if tokenizer is not None:
            pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
        dataset = cls(read_records(path), seq_len, tokenizer, vocab_size, int(pad), source=path)
        dataset.first_valid_record()
        return dataset

    def __len__(self) -> int:
        return len(self.records)

    @property
    def malformed(self) -> int:
        return len(self._bad)

    def first_valid_record(self) -> int:
        """Index of the first record that encodes, else a `DataError` naming the first problem."""
        first_problem = None
        for index, raw in enumerate(self.records):
            try:
                encode_record(parse_record(raw), self.tokenizer, self.vocab_size)
                return index
            except MalformedRecord as e:
                first_problem = first_problem or f"record {index + 1}: {e}"
        raise DataError(f"{self.source}: none of its {len(self.records)} records is valid ({first_problem})",
                        hint=f"records are {RECORD_LAYOUTS}")

    def encode(self, index: int):
        try:
            ids, mask = encode_record(parse_record(self.records[index]), self.tokenizer, self.vocab_size)
            return (*pad_row(ids, mask, self.seq_len, self.pad_id), False)
        except MalformedRecord as e:
            if index in self._bad:
                return (*pad_row([], [], self.seq_len, self.pad_id), True)
            self._bad.add(index)
            if self._warned < MAX_WARNINGS:
                self._warned += 1
                log.warning("skipping malformed record %d: %s%s", index, e,
                            " (further warnings suppressed)" if self._warned == MAX_WARNINGS else "")
            return (*pad_row([], [], self.seq_len, self.pad_id), True)


def index_pipeline(num_records: int, global_batch: int, seed: int):
    """grain pipeline of global batches of record indices: shuffled anew each epoch, infinite; its
    iterator's `get_state()` / `set_state()` is the data checkpoint."""
    import grain.python as grain     # lazy: seconds to import; readers of records (bench, regen) skip it
    ds = grain.MapDataset.range(num_records).shuffle(seed=seed).repeat(None).batch(global_batch)
    return ds.to_iter_dataset()


def process_rows(sharding, global_shape) -> tuple[int, int]:
    """The `[lo, hi)` batch rows held by this process's devices under `sharding` (contiguous)."""
    rows = set()
    for index in sharding.addressable_devices_indices_map(tuple(global_shape)).values():
        sl = index[0]
        rows.update(range(*sl.indices(global_shape[0])))
    lo, hi = min(rows), max(rows) + 1
    if len(rows) != hi - lo:
        raise ValueError("this process's batch rows are not contiguous; use a mesh whose data axes "
                         "follow the process order")
    return lo, hi


class BatchIterator:
    """Global batches for the train step, this process's rows only: `next()` ->
    `{"tokens_bt": int32 [rows, L], "loss_mask_bt": int32 [rows, L], "malformed": int}`;
    `get_state()` / `set_state()`.

    Example:
        >>> it = BatchIterator(TokenDataset.from_records([{"input_ids": [1, 2]}] * 4, 8), 2, (0, 2))
        >>> it.next()["tokens_bt"].shape
        (2, 8)
    """

    def __init__(self, dataset: TokenDataset, global_batch: int, rows: tuple[int, int], seed: int = 0):
        self.dataset, self.rows = dataset, rows
        self._it = iter(index_pipeline(len(dataset), global_batch, seed))

    def next(self) -> dict:
        indices = np.asarray(next(self._it))[self.rows[0]:self.rows[1]]
        encoded = [self.dataset.encode(int(i)) for i in indices]
        return {"tokens_bt": np.stack([e[0] for e in encoded]),
                "loss_mask_bt": np.stack([e[1] for e in encoded]),
                "malformed": int(sum(e[2] for e in encoded))}

    def get_state(self) -> dict:
        return dict(self._it.get_state())

    def set_state(self, state: dict) -> None:
        self._it.set_state(state)
