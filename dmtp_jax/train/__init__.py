"""Drafter training: data (grain), frozen-target features, anchors, loss, the jitted step, the loop.

Example:
    >>> from dmtp_jax.train.loop import TrainConfig, run_training  # doctest: +SKIP
    >>> run_training(TrainConfig(target="/models/tiny", data="d.jsonl", out="/tmp/run", steps=10))  # doctest: +SKIP
"""
