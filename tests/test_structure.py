"""Structural contracts read from the code: argparse stays at the command-line edge, and the models'
phases carry `jax.named_scope`s a profile can read (one lowering of a tiny target, nothing compiled)."""

import ast
import os

import jax
import jax.numpy as jnp
from flax import nnx

from dmtp_jax.config import TargetConfig
from dmtp_jax.models.mtp import MtpHead, mtp_config_for
from dmtp_jax.models.qwen3 import QwenTarget

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "dmtp_jax")
ARGPARSE_EDGES = {"cli.py", os.path.join("demo", "cards.py")}     # the CLIs' shared parser; a `python -m` entry


def test_argparse_only_at_the_edge():
    users = set()
    for folder, _, files in os.walk(ROOT):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(folder, f)
                for node in ast.walk(ast.parse(open(path).read(), path)):
                    names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                             else [node.module] if isinstance(node, ast.ImportFrom) else [])
                    if "argparse" in names:
                        users.add(os.path.relpath(path, ROOT))
    assert users <= ARGPARSE_EDGES, f"argparse below the CLI edge: {sorted(users - ARGPARSE_EDGES)}"


def test_model_phases_are_named_scopes():
    cfg = TargetConfig.from_hf_dict({"model_type": "qwen3_5_moe", "vocab_size": 64, "hidden_size": 16,
                                     "intermediate_size": 32, "moe_intermediate_size": 8, "num_experts": 4,
                                     "num_experts_per_tok": 2, "num_hidden_layers": 4, "num_attention_heads": 2,
                                     "num_key_value_heads": 1, "head_dim": 8, "linear_num_key_heads": 1,
                                     "linear_num_value_heads": 2, "linear_key_head_dim": 8,
                                     "linear_value_head_dim": 8})
    target = QwenTarget(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0))
    mtp = MtpHead(mtp_config_for(cfg), dtype=jnp.float32, rngs=nnx.Rngs(1))
    graphdefs, states = zip(*(nnx.split(m) for m in (target, mtp)))

    def forward(states, tokens_bt):
        model, head = (nnx.merge(g, s) for g, s in zip(graphdefs, states))
        positions = jnp.broadcast_to(jnp.arange(tokens_bt.shape[1]), tokens_bt.shape)
        hidden = model(tokens_bt, positions).hidden_bth
        h, _ = head(model.embed(tokens_bt), hidden, positions)
        return model.logits(head.post_norm(h))

    text = jax.jit(forward).lower(states, jnp.zeros((1, 4), jnp.int32)).as_text(debug_info=True)
    for scope in ("embed", "attention", "linear_attention", "mlp", "final_norm", "lm_head", "mtp"):
        assert f"/{scope}/" in text or f'"{scope}/' in text, scope
