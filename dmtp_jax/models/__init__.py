"""Model families. `build_target(cfg, dtype, rngs)` picks the module for a target config."""

from dmtp_jax.models.qwen3 import QwenTarget, TargetOutput  # noqa: F401


def build_target(cfg, dtype, rngs):
    """The NNX module for `cfg.model_type` (every Qwen family shares one module)."""
    return QwenTarget(cfg, dtype=dtype, rngs=rngs)
