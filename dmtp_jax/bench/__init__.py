"""The paper's benchmark: workloads, a runner over every decode method, and the report.

* `workloads`: named public eval sets read from the shared data directory (gsm8k, math500,
  humaneval, mt_bench, alpaca_eval, spec_bench, bfcl) or a user JSONL, turned into prompt ids.
* `runner`: runs each method over a workload in batches (warm-up and compiles excluded from timing)
  and keeps every output.
* `report`: pooled acceptance statistics per method, the table, the JSON and the PNG.

Example (the CLI is `python infer.py bench`; a named workload needs the hub or `--data-dir`):
    >>> import pathlib, tempfile
    >>> from dmtp_jax.bench.workloads import load_workload
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "mine.jsonl"
    >>> _ = path.write_text('{"prompt_ids": [1, 2, 3]}\\n{"turns": ["Hi.", "More."]}\\n')
    >>> wl = load_workload(str(path))
    >>> len(wl.requests), wl.num_generations
    (2, 3)
"""
