"""Small copies of the named bench workloads' files, in their real layouts (`bench/workloads.py`),
written by the tests themselves: the parsers are checked on a clean clone without `../shared/data`.

`write_small_workloads(root)` writes every file of `WORKLOADS` under `root` and returns `root`;
`EXPECTED[name]` is what `load_workload(name, root)` must give: `(id, turns, system, tool names)` per
request.
"""

from __future__ import annotations

import gzip
import json
import os

from dmtp_jax.bench.workloads import HUMANEVAL_FORMAT, REASON_SUFFIX

TURNS = [{"question_id": 81, "category": "writing", "turns": ["Write a poem.", "Now shorter."]},
         {"question_id": 82, "category": "writing", "turns": ["Draft an email.", "Make it polite."]}]
BFCL_SIMPLE = [{"id": "simple_python_0",
                "question": [[{"role": "user", "content": "Area of a triangle, base 10, height 5?"}]],
                "function": [{"name": "triangle_area", "parameters": {"type": "dict", "properties": {}}}]}]
BFCL_MULTIPLE = [{"id": "multiple_0",
                  "question": [[{"role": "system", "content": "Be brief."},
                                {"role": "user", "content": "Sides 5, 4, 3: properties?"}]],
                  "function": [{"name": "triangle.get"}, {"name": "circle.get"}]}]
FILES = {
    "gsm8k/test.jsonl": [{"question": "1 + 1?", "answer": "#### 2"}, {"question": "2 + 2?", "answer": "#### 4"}],
    "math500/test.jsonl": [{"problem": "Solve $x^2 = 4$.", "solution": "...", "unique_id": "test/algebra/1.json"},
                           {"problem": "What is $3!$?", "solution": "...", "unique_id": "test/counting/2.json"}],
    "humaneval/HumanEval.jsonl.gz": [{"task_id": "HumanEval/0", "prompt": "def add(a, b):\n    \"\"\"Sum.\"\"\"\n",
                                      "test": "assert add(1, 2) == 3"}],
    "mt_bench/question.jsonl": TURNS,
    "alpaca_eval/model_outputs.json": [{"dataset": "helpful_base", "instruction": "Name a Broadway actor.",
                                        "output": "...", "generator": "text_davinci_003"},
                                       {"dataset": "oasst", "instruction": "Why is the sky blue?", "output": "..."}],
    "spec_bench/question.jsonl": TURNS + [{"question_id": 100, "category": "qa", "turns": ["One turn only?"]}],
    "bfcl/BFCL_v4_simple_python.json": BFCL_SIMPLE,
    "bfcl/BFCL_v4_multiple.json": BFCL_MULTIPLE,
}
EXPECTED = {
    "gsm8k": [("0", ("1 + 1?" + REASON_SUFFIX,), None, None), ("1", ("2 + 2?" + REASON_SUFFIX,), None, None)],
    "math500": [("test/algebra/1.json", ("Solve $x^2 = 4$." + REASON_SUFFIX,), None, None),
                ("test/counting/2.json", ("What is $3!$?" + REASON_SUFFIX,), None, None)],
    "humaneval": [("HumanEval/0", (HUMANEVAL_FORMAT.format(prompt='def add(a, b):\n    """Sum."""\n'),), None, None)],
    "mt_bench": [("81", ("Write a poem.", "Now shorter."), None, None),
                 ("82", ("Draft an email.", "Make it polite."), None, None)],
    "alpaca_eval": [("0", ("Name a Broadway actor.",), None, None), ("1", ("Why is the sky blue?",), None, None)],
    "spec_bench": [("81", ("Write a poem.", "Now shorter."), None, None),
                   ("82", ("Draft an email.", "Make it polite."), None, None), ("100", ("One turn only?",), None, None)],
    "bfcl": [("simple_python_0", ("Area of a triangle, base 10, height 5?",), None, ("triangle_area",)),
             ("multiple_0", ("Sides 5, 4, 3: properties?",), "Be brief.", ("triangle.get", "circle.get"))],
}


def write_small_workloads(root: str) -> str:
    """Every named workload's files under `root`: JSON lines, the alpaca_eval JSON list, HumanEval gzipped."""
    for rel, records in FILES.items():
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if rel.endswith("model_outputs.json"):
            text = json.dumps(records, indent=2)
        else:
            text = "".join(json.dumps(r) + "\n" for r in records)
        with (gzip.open(path, "wt", encoding="utf-8") if rel.endswith(".gz") else open(path, "w")) as fh:
            fh.write(text)
    return root
