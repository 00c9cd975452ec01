"""The commands behind `infer.py` and `train.py`: each takes the parsed arguments and returns the
exit status (`dmtp_jax.cli.run_command` turns a `UserError` into one `error:` line)."""
