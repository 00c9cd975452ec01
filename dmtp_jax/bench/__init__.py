"""The paper's benchmark: workloads, a runner over every decode method, and the report.

* `workloads`: named public eval sets read from the shared data directory (gsm8k, math500,
  humaneval, mt_bench, alpaca_eval, spec_bench, bfcl) or a user JSONL, turned into prompt ids.
* `runner`: runs each method over a workload in batches (warm-up and compiles excluded from timing)
  and keeps every output.
* `report`: pooled acceptance statistics per method, the table, the JSON and the PNG.

Example (the CLI is `python infer.py bench`):
    >>> from dmtp_jax.bench.workloads import load_workload
    >>> wl = load_workload("gsm8k", num_prompts=2)  # doctest: +SKIP
    >>> len(wl.requests)  # doctest: +SKIP
    2
"""
