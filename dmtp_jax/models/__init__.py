"""Model families. `build_target(cfg, dtype, rngs)` picks the module for a target config."""

from dmtp_jax.models.deepseek import DeepSeekTarget
from dmtp_jax.models.gemma4 import GemmaTarget
from dmtp_jax.models.qwen3 import QwenTarget, TargetOutput  # noqa: F401


def build_target(cfg, dtype, rngs, scan_layers: bool = True, mesh_rules=None):
    """The NNX module for `cfg.model_type` (every Qwen family shares one module; DeepSeek-V3 /
    GLM-4.7-Flash its MLA subclass, Gemma 4 its own); `scan_layers=False` runs the layers as one unrolled loop
    (`models/layer_stack.py`); `mesh_rules`: those its params are placed with."""
    module = DeepSeekTarget if cfg.is_mla else GemmaTarget if cfg.gemma is not None else QwenTarget
    return module(cfg, dtype=dtype, rngs=rngs, scan_layers=scan_layers, mesh_rules=mesh_rules)
