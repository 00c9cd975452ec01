"""The paper's benchmark (`python infer.py bench`): `workloads` (named eval sets or a user JSONL, as
prompt ids), `runner` (each method over a workload in batches, compiles excluded from timing) and
`report` (pooled acceptance statistics, the table, the JSON and the PNG)."""
