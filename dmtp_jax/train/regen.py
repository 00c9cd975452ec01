"""Regeneration: the frozen target answers the training prompts (DFlash trains on this text).

Each record gives a prompt (`prompt_of`); each answered record is one JSONL line
`{"source_index", "input_ids": prompt + answer, "loss_mask": [0]*len(prompt) + [1]*len(answer)}`
(plus `"messages"` when a tokenizer is present). Resumable: records whose `source_index` is in the
output are skipped; each batch is appended and flushed when done."""

from __future__ import annotations

import dataclasses
import json
import logging
import os

from tqdm.auto import tqdm

from dmtp_jax.checkpoint.dflash_ckpt import load_drafter
from dmtp_jax.checkpoint.hf import load_target
from dmtp_jax.decode import make_decoder
from dmtp_jax.decode.sampling import SamplingParams
from dmtp_jax.errors import DataError, InputError
from dmtp_jax.sharding import make_mesh
from dmtp_jax.tokenizer import load_tokenizer, stop_token_ids
from dmtp_jax.train.data import MalformedRecord, parse_record, read_records, render_chat

log = logging.getLogger(__name__)


@dataclasses.dataclass
class RegenConfig:
    target: str = ""
    data: str = ""
    out: str = ""
    method: str = "ar"
    draft: str | None = None
    batch_size: int = 8
    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    max_prompt_len: int | None = None
    dtype: str = "float32"
    mesh: str | None = None
    progress: bool = True


def prompt_of(record: dict, tokenizer=None) -> tuple[list[int], list | None]:
    """`(prompt ids, prompt messages or None)` of a parsed record; raises `MalformedRecord`.

    Example:
        >>> prompt_of({"input_ids": [1, 2, 3, 4], "loss_mask": [0, 0, 1, 1]})
        ([1, 2], None)
    """
    if "input_ids" in record:
        ids, mask = record["input_ids"], record.get("loss_mask")
        if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
            raise MalformedRecord("'input_ids' must be a list of integers")
        if isinstance(mask, list) and len(mask) == len(ids) and any(mask):
            ids = ids[:[bool(m) for m in mask].index(True)]
        if not ids:
            raise MalformedRecord("empty prompt")
        return list(ids), None
    if tokenizer is None:
        raise MalformedRecord("'messages' / 'text' records need a target with a tokenizer")
    if "messages" in record:
        msgs = record["messages"]
        if not isinstance(msgs, list) or not all(isinstance(m, dict) and "role" in m for m in msgs):
            raise MalformedRecord("'messages' must be a list of {role, content}")
        while msgs and msgs[-1]["role"] == "assistant":
            msgs = msgs[:-1]
        if not msgs:
            raise MalformedRecord("no prompt turns")
        text = render_chat(tokenizer, msgs, True)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"]), msgs
    if "text" in record and isinstance(record["text"], str):
        return list(tokenizer(record["text"], add_special_tokens=False)["input_ids"]), None
    raise MalformedRecord("unknown record layout; expected 'input_ids', 'messages' or 'text'")


def done_indices(out_path: str) -> set[int]:
    """`source_index` values already written (a torn last line is ignored and rewritten)."""
    done = set()
    if not os.path.isfile(out_path):
        return done
    good = []
    with open(out_path) as fh:
        for line in fh:
            try:
                done.add(int(json.loads(line)["source_index"]))
                good.append(line)
            except (ValueError, KeyError, TypeError):
                continue
    with open(out_path, "w") as fh:      # drop a line torn by a kill
        fh.writelines(good)
    return done


def run_regen(cfg: RegenConfig) -> dict:
    """Answers every not-yet-answered prompt: `{"written", "skipped_done", "malformed"}`."""

    for name in ("target", "data", "out"):
        if not getattr(cfg, name):
            raise InputError(f"--{name} is required")
    if cfg.batch_size < 1 or cfg.max_new_tokens < 1:
        raise InputError("--batch-size and --max-new-tokens must be >= 1")
    records = read_records(cfg.data)
    mesh = make_mesh(cfg.mesh)
    target = load_target(cfg.target, cfg.dtype, mesh)
    tokenizer = load_tokenizer(cfg.target)
    drafter = load_drafter(cfg.draft, target.cfg, cfg.dtype, mesh) if cfg.draft else None
    decoder = make_decoder(cfg.method, target, drafter)
    sampling = SamplingParams.make(cfg.temperature, cfg.top_p, cfg.top_k)
    stops = stop_token_ids(cfg.target, target.cfg.eos_token_ids, tokenizer)
    limit = target.cfg.max_position_embeddings - cfg.max_new_tokens - 64
    if cfg.max_prompt_len:
        limit = min(limit, cfg.max_prompt_len)

    os.makedirs(os.path.dirname(os.path.abspath(cfg.out)), exist_ok=True)
    done = done_indices(cfg.out)
    todo, malformed, problems = [], 0, []
    for i, raw in enumerate(records):
        if i in done:
            continue
        try:
            ids, msgs = prompt_of(parse_record(raw), tokenizer)
            if len(ids) > limit:
                raise MalformedRecord(f"prompt of {len(ids)} tokens exceeds the limit {limit}")
            if not all(0 <= t < target.cfg.vocab_size for t in ids):
                raise MalformedRecord("prompt ids outside the vocabulary")
            todo.append((i, ids, msgs))
        except MalformedRecord as e:
            malformed += 1
            problems.append((i, e))
    if not todo and not done:
        first = f"record {problems[0][0] + 1}: {problems[0][1]}" if problems else "empty"
        raise DataError(f"{cfg.data}: none of its {len(records)} records is a valid prompt ({first})")
    for i, e in problems[:20]:
        log.warning("skipping record %d: %s", i, e)
    written = 0
    bar = tqdm(total=len(records), initial=len(done), disable=not cfg.progress, unit="rec")
    with open(cfg.out, "a") as fh:
        for start in range(0, len(todo), cfg.batch_size):
            chunk = todo[start:start + cfg.batch_size]
            res = decoder.generate([c[1] for c in chunk], cfg.max_new_tokens, sampling,
                                   seed=cfg.seed + chunk[0][0], stop_ids=stops)
            for (i, ids, msgs), answer in zip(chunk, res.output_ids):
                rec = {"source_index": i, "input_ids": ids + answer,
                       "loss_mask": [0] * len(ids) + [1] * len(answer)}
                if tokenizer is not None and msgs is not None:
                    text = tokenizer.decode([t for t in answer if t not in stops], skip_special_tokens=True)
                    rec["messages"] = msgs + [{"role": "assistant", "content": text}]
                fh.write(json.dumps(rec) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
            written += len(chunk)
            bar.update(len(chunk))
            if "per_verify_acceptance_length" in res.stats:
                bar.set_postfix(acc_len=f"{res.stats['per_verify_acceptance_length']:.2f}", refresh=False)
    bar.close()
    return {"written": written, "skipped_done": len(done), "malformed": malformed}
