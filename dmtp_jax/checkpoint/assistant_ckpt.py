"""A `gemma4_assistant` directory -> `models/gemma4_assistant.GemmaAssistant` (names:
`checkpoint/gemma_names.py`). Its `token_ordering` is read as int32 whatever the load dtype."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from dmtp_jax.checkpoint.gemma_names import assistant_rules
from dmtp_jax.checkpoint.hf import QWEN_NAME_RULES, LoadedModel, load_params
from dmtp_jax.checkpoint.safetensors_io import CheckpointError, CheckpointReader
from dmtp_jax.config import TargetConfig, read_config_json
from dmtp_jax.models.gemma4_assistant import AssistantConfig, GemmaAssistant, assistant_config_from_hf
from dmtp_jax.sharding import DEFAULT_RULES, MeshRules, make_mesh, replicated

ORDERING = "masked_embedding.token_ordering"


def is_assistant_dir(model_dir: str) -> bool:
    """Whether `model_dir` holds a `gemma4_assistant` (its `config.json`'s model_type)."""
    try:
        return read_config_json(model_dir).get("model_type") == "gemma4_assistant"
    except Exception:  # noqa: BLE001  (no readable config: not an assistant)
        return False


def load_assistant(model_dir: str, target_cfg: TargetConfig, dtype="float32", mesh: Mesh | None = None,
                   mesh_rules: MeshRules = DEFAULT_RULES) -> LoadedModel:
    """The assistant of `model_dir` for `target_cfg`, placed on `mesh`."""
    acfg: AssistantConfig = assistant_config_from_hf(read_config_json(model_dir), target_cfg)
    mesh = mesh or make_mesh()
    model = nnx.eval_shape(lambda: GemmaAssistant(acfg, dtype=jnp.dtype(dtype), rngs=nnx.Rngs(0)))
    graphdef, abstract = nnx.split(model)
    reader = CheckpointReader(model_dir)
    flat = nnx.to_flat_state(abstract)
    weights = nnx.from_flat_state([(p, v) for p, v in flat if p[-1] != "token_ordering"])
    state, _ = load_params(weights, reader, mesh, dtype, rules=assistant_rules(QWEN_NAME_RULES),
                           mesh_rules=mesh_rules)
    loaded = list(nnx.to_flat_state(state))
    for path, var in flat:
        if path[-1] == "token_ordering":
            if ORDERING not in reader:
                raise CheckpointError(f"{model_dir}: missing tensor '{ORDERING}'")
            order = np.asarray(reader.array(ORDERING)).astype(np.int32)
            loaded.append((path, var.replace(jax.device_put(order, replicated(mesh)))))
    return LoadedModel(acfg, graphdef, nnx.from_flat_state(loaded), mesh, model_dir)
