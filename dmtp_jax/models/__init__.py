"""Model families. `build_target(cfg, dtype, rngs)` picks the module for a target config."""

from dmtp_jax.models.qwen3 import Qwen3Target, TargetOutput  # noqa: F401


def build_target(cfg, dtype, rngs):
    """The NNX module for `cfg.model_type` (qwen3 and qwen3_moe share one module)."""
    return Qwen3Target(cfg, dtype=dtype, rngs=rngs)
