"""Benchmark workloads: public eval prompts (from the hub or a local directory), or a user JSONL.

Named workloads (`WORKLOADS`: gsm8k, math500, humaneval, mt_bench, alpaca_eval, spec_bench, bfcl;
files and sources: docs/benchmarks.md#workloads) are read by `sources.named_records`, never
copied. A user JSONL holds `{"prompt"}`, `{"turns"}` or `{"prompt_ids"}` records. Turn k's prompt
carries the model's own answers to turns 1..k-1, rendered with the chat template
(`add_generation_prompt=True`) or, without one, joined with blank lines.

Example:
    >>> wl = parse_user_lines(['{"prompt_ids": [1, 2, 3]}', '{"turns": ["a", "b"]}'], "x.jsonl")
    >>> [r.prompt_ids for r in wl], [r.turns for r in wl]
    ([(1, 2, 3), None], [(), ('a', 'b')])
    >>> render_prompt(wl[0], tokenizer=None, answers=[])
    [1, 2, 3]
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Callable

from dmtp_jax.bench.sources import DATA_ENV, named_records, sibling_data_dir
from dmtp_jax.errors import WorkloadError

REASON_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."
HUMANEVAL_FORMAT = ("Write a solution to the following problem and make sure that it passes the tests:\n"
                    "```python\n{prompt}\n```")
TOOLS_PREAMBLE = "You have access to the following functions (JSON schema, one per line):\n"


@dataclasses.dataclass(frozen=True)
class Request:
    """One benchmark request: user turns (text) or raw `prompt_ids`; optional system / tools."""
    id: str
    turns: tuple[str, ...] = ()
    prompt_ids: tuple[int, ...] | None = None
    system: str | None = None
    tools: tuple | None = None          # JSON function specs (bfcl)

    @property
    def num_turns(self) -> int:
        return 1 if self.prompt_ids is not None else len(self.turns)

    @property
    def is_text(self) -> bool:
        return self.prompt_ids is None


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    source: str                         # file(s) read
    requests: tuple[Request, ...]

    @property
    def num_generations(self) -> int:
        """Generate calls per method (one per turn of every request)."""
        return sum(r.num_turns for r in self.requests)

    @property
    def needs_tokenizer(self) -> bool:
        return any(r.is_text for r in self.requests)


# ---- data directory -------------------------------------------------------------------------
def default_data_dir() -> str:
    """The local data directory: `$DMTP_JAX_DATA`, else `<repo>/../shared/data`."""
    return os.environ.get(DATA_ENV) or sibling_data_dir()


# ---- named workloads --------------------------------------------------------------------------
def _single(rid, text) -> Request:
    return Request(id=str(rid), turns=(text,))


def _gsm8k(recs):
    return [_single(i, r["question"] + REASON_SUFFIX) for i, r in enumerate(recs)]


def _math500(recs):
    return [_single(r.get("unique_id", i), r["problem"] + REASON_SUFFIX) for i, r in enumerate(recs)]


def _humaneval(recs):
    return [_single(r["task_id"], HUMANEVAL_FORMAT.format(prompt=r["prompt"])) for r in recs]


def _turns(recs):
    return [Request(id=str(r["question_id"]), turns=tuple(r["turns"])) for r in recs]


def _alpaca(recs):
    return [_single(i, r["instruction"]) for i, r in enumerate(recs)]


def _bfcl(recs):
    out = []
    for r in recs:
        turns, system = [], None
        for turn in r["question"]:
            for msg in turn:
                if msg["role"] == "system":
                    system = msg["content"]
                elif msg["role"] == "user":
                    turns.append(msg["content"])
        out.append(Request(id=r["id"], turns=tuple(turns), system=system, tools=tuple(r["function"])))
    return out


@dataclasses.dataclass(frozen=True)
class WorkloadSpec:
    files: tuple[str, ...]
    parse: Callable[[list], list[Request]]


WORKLOADS: dict[str, WorkloadSpec] = {
    "gsm8k": WorkloadSpec(("gsm8k/test.jsonl",), _gsm8k),
    "math500": WorkloadSpec(("math500/test.jsonl",), _math500),
    "humaneval": WorkloadSpec(("humaneval/HumanEval.jsonl.gz",), _humaneval),
    "mt_bench": WorkloadSpec(("mt_bench/question.jsonl",), _turns),
    "alpaca_eval": WorkloadSpec(("alpaca_eval/model_outputs.json",), _alpaca),
    "spec_bench": WorkloadSpec(("spec_bench/question.jsonl",), _turns),
    "bfcl": WorkloadSpec(("bfcl/BFCL_v4_simple_python.json", "bfcl/BFCL_v4_multiple.json"), _bfcl),
}


# ---- user JSONL -------------------------------------------------------------------------------
def parse_user_record(obj, where: str, index: int) -> Request:
    """One user record (`prompt`, `turns` or `prompt_ids`); `where` names it in errors."""
    if not isinstance(obj, dict):
        raise WorkloadError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    keys = [k for k in ("prompt", "turns", "prompt_ids") if k in obj]
    if len(keys) != 1:
        raise WorkloadError(f"{where}: a record needs exactly one of 'prompt', 'turns', 'prompt_ids'"
                            f" (found {keys or sorted(obj)})")
    rid = str(obj.get("id", index))
    value = obj[keys[0]]
    if keys[0] == "prompt":
        if not isinstance(value, str) or not value:
            raise WorkloadError(f"{where}: 'prompt' must be a non-empty string")
        return Request(id=rid, turns=(value,), system=obj.get("system"))
    if keys[0] == "turns":
        if not isinstance(value, list) or not value or not all(isinstance(t, str) and t for t in value):
            raise WorkloadError(f"{where}: 'turns' must be a non-empty list of non-empty strings")
        return Request(id=rid, turns=tuple(value), system=obj.get("system"))
    if (not isinstance(value, list) or not value
            or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value)):
        raise WorkloadError(f"{where}: 'prompt_ids' must be a non-empty list of non-negative integers")
    return Request(id=rid, prompt_ids=tuple(value))


def parse_user_lines(lines, path: str) -> list[Request]:
    """Requests of a user JSONL given as lines (blank lines skipped); errors name `path:line`."""
    out = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise WorkloadError(f"{path}:{i}: not valid JSON ({e.msg})") from None
        out.append(parse_user_record(obj, f"{path}:{i}", len(out)))
    return out


# ---- loading ----------------------------------------------------------------------------------
def load_workload(name: str, data_dir: str | None = None, num_prompts: int | None = None) -> Workload:
    """A named workload from the data directory, or a user JSONL file; the first `num_prompts`.

    Example:
        >>> import json, pathlib, tempfile
        >>> root = pathlib.Path(tempfile.mkdtemp())
        >>> (root / "mt_bench").mkdir()
        >>> record = {"question_id": 81, "turns": ["Write a poem.", "Now shorter."]}
        >>> _ = (root / "mt_bench" / "question.jsonl").write_text(json.dumps(record))
        >>> load_workload("mt_bench", str(root), num_prompts=1).requests[0].num_turns
        2
    """
    if num_prompts is not None and num_prompts < 1:
        raise WorkloadError(f"--num-prompts must be >= 1, got {num_prompts}")
    if name in WORKLOADS:
        spec = WORKLOADS[name]
        records, source = named_records(name, spec.files, data_dir)
        try:
            requests = spec.parse(records)
        except (KeyError, TypeError, AttributeError) as e:
            raise WorkloadError(f"{source}: unexpected record layout ({type(e).__name__}: {e})") from None
    elif name.endswith((".jsonl", ".json")) or os.path.isfile(name):
        if not os.path.isfile(name):
            raise WorkloadError(f"workload file {name} does not exist")
        with open(name, encoding="utf-8") as fh:
            requests = parse_user_lines(fh, name)
        source = name
        name = os.path.basename(name)
    else:
        raise WorkloadError(f"unknown workload '{name}'; choose one of {', '.join(WORKLOADS)} "
                            f"or give a .jsonl file")
    if not requests:
        raise WorkloadError(f"workload '{name}' has no records")
    if num_prompts is not None:
        requests = requests[:num_prompts]
    return Workload(name, source, tuple(requests))


# ---- prompts ----------------------------------------------------------------------------------
def check_tokenizer(workload: Workload, tokenizer, target_dir: str = "the target") -> None:
    """Raises a one-line `WorkloadError` when text prompts meet a target without a tokenizer."""
    if tokenizer is None and workload.needs_tokenizer:
        raise WorkloadError(f"workload '{workload.name}' has text prompts but {target_dir} has no tokenizer; "
                            f"use a JSONL of {{\"prompt_ids\": [...]}} records")


def _tools_text(tools) -> str:
    return TOOLS_PREAMBLE + "\n".join(json.dumps(t) for t in tools)


def build_messages(request: Request, answers: list[str], tools_in_template: bool) -> list[dict]:
    """The chat messages for turn `len(answers)` of `request` (answers = the model's previous ones).

    Example:
        >>> build_messages(Request("0", turns=("a", "b")), ["A"], False)
        [{'role': 'user', 'content': 'a'}, {'role': 'assistant', 'content': 'A'}, {'role': 'user', 'content': 'b'}]
    """
    system = request.system
    if request.tools and not tools_in_template:
        system = (system + "\n\n" if system else "") + _tools_text(request.tools)
    msgs = [{"role": "system", "content": system}] if system else []
    for turn, answer in zip(request.turns, answers):
        msgs += [{"role": "user", "content": turn}, {"role": "assistant", "content": answer}]
    msgs.append({"role": "user", "content": request.turns[len(answers)]})
    return msgs


def raw_text(request: Request, answers: list[str]) -> str:
    """The prompt without a chat template: system / tools, turns and answers joined by blank lines."""
    parts = [request.system] if request.system else []
    if request.tools:
        parts.append(_tools_text(request.tools))
    for turn, answer in zip(request.turns, answers):
        parts += [turn, answer]
    parts.append(request.turns[len(answers)])
    return "\n\n".join(parts)


def render_prompt(request: Request, tokenizer, answers: list[str]) -> list[int]:
    """Prompt ids of turn `len(answers)` (`answers`: the model's decoded earlier answers): the chat
    template when the tokenizer has one, else raw text."""
    if request.prompt_ids is not None:
        return list(request.prompt_ids)
    if tokenizer is None:
        raise WorkloadError(f"request {request.id} is text but the target has no tokenizer")
    if len(answers) >= len(request.turns):
        raise ValueError(f"request {request.id} has {len(request.turns)} turns, asked for turn {len(answers) + 1}")
    template = getattr(tokenizer, "chat_template", None)
    if template:
        tools_in_template = bool(request.tools) and "tools" in str(template)
        kwargs = {"tools": list(request.tools)} if tools_in_template else {}
        text = tokenizer.apply_chat_template(build_messages(request, answers, tools_in_template),
                                             tokenize=False, add_generation_prompt=True, **kwargs)
        return list(tokenizer(text, add_special_tokens=False).input_ids)
    return list(tokenizer(raw_text(request, answers)).input_ids)
