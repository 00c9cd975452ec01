"""Drafter training: data (grain), frozen-target features, anchors, loss, the jitted step, the loop.

Example:
    >>> from dmtp_jax.train.config import TrainConfig
    >>> from dmtp_jax.train.run import run_training
    >>> run_training(TrainConfig(target="/models/tiny", data="d.jsonl", out="/tmp/run", steps=10))  # doctest: +SKIP
"""
