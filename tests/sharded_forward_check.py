"""Runs one forward and a few greedy `ARDecoder` tokens of a checkpoint on several meshes; prints JSON.

Run in a fresh process so that fake CPU devices can be requested before jax is imported:

    XLA_FLAGS=--xla_force_host_platform_device_count=8 \\
        python tests/sharded_forward_check.py CKPT_DIR [CKPT_DIR ...] --mesh tensor=1 --mesh fsdp=8 [--mtp DIR]

Output: `{ckpt_dir: {mesh_spec: {"logits": [B][T][V] floats (fp32), "greedy": [[int]],
"spec_greedy": [[int]] (greedy `mtp` speculative decoding, for checkpoints with `mtp.*`, drafting with a
small efficient head over a 40-id vocabulary subset: each vocabulary shard shortlists and rescores its
own rows; with `--mtp DIR` (a separate head, e.g. a `gemma4_assistant`): greedy `mtp` with that head alone;
else None), "shortlist": {"all" / "subset": a small efficient head over the whole vocabulary /
that subset: ids kept per position, its max |logit diff| on them, ids kept outside the subset, its rows'
spec} (or None),
"specs": {param path: PartitionSpec str}, "devices": {param path: number of devices holding it},
"cache_specs": {target cache leaf path: PartitionSpec str}, "mtp_specs": {`--mtp` head param path:
PartitionSpec str} (or None), "num_devices": int}}}`. Tokens are sharded
over the batch mesh axes like a real batch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from dmtp_jax.checkpoint.hf import load_target  # noqa: E402
from dmtp_jax.checkpoint.mtp_ckpt import has_mtp, load_mtp  # noqa: E402
from dmtp_jax.decode import make_decoder  # noqa: E402
from dmtp_jax.decode.ar import ARDecoder  # noqa: E402
from dmtp_jax.checkpoint.draft_head_ckpt import make_efficient_head  # noqa: E402
from dmtp_jax.sharding import batch_sharding, make_mesh  # noqa: E402

BATCH, MAX_LEN, NEW_TOKENS = 8, 40, 5


def prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=int(n)).tolist() for n in np.linspace(5, MAX_LEN, BATCH)]


def run(ckpt: str, spec: str, mtp_dir: str | None = None) -> dict:
    mesh = make_mesh(spec)
    target = load_target(ckpt, "float32", mesh)
    batch = prompts(target.cfg.vocab_size)
    tokens = np.zeros((BATCH, MAX_LEN), np.int32)
    for i, p in enumerate(batch):
        tokens[i, :len(p)] = p
    tokens = jax.device_put(tokens, batch_sharding(mesh, tokens.shape))

    @jax.jit
    def forward(state, tokens_bt):
        model = nnx.merge(target.graphdef, state)
        positions = jnp.broadcast_to(jnp.arange(tokens_bt.shape[1]), tokens_bt.shape)
        return model.logits(model(tokens_bt, positions).hidden_bth)

    logits = np.asarray(forward(target.state, tokens))
    decoder = ARDecoder(target)
    greedy = decoder.generate(batch, NEW_TOKENS, stop_ids=[]).output_ids
    cache_specs = {".".join(str(getattr(k, "name", getattr(k, "idx", k))) for k in path): str(leaf.sharding.spec)
                   for path, leaf in jax.tree_util.tree_leaves_with_path(decoder.caches.new(BATCH, MAX_LEN))}
    spec_greedy = shortlist = mtp_specs = None
    if mtp_dir:
        mtp = load_mtp(mtp_dir, target.cfg, "float32", mesh)
        engine = make_decoder("mtp", target, mtp=mtp, mtp_steps=2)
        spec_greedy = engine.generate(batch, NEW_TOKENS, stop_ids=[]).output_ids
        mtp_specs = {".".join(str(p) for p in path): str(var.get_value().sharding.spec)
                     for path, var in nnx.to_flat_state(mtp.state)}
    elif has_mtp(ckpt):
        # the whole vocabulary, and a subset of 40 ids (spread over every vocabulary shard)
        counts = (np.arange(target.cfg.vocab_size) * 37) % 101
        heads = {"all": make_efficient_head(target, rank=2, shortlist=8),
                 "subset": make_efficient_head(target, rank=2, shortlist=8, counts=counts, subset=40)}
        names = list(heads)

        @jax.jit
        def head_check(state, head_states, tokens_bt):  # per head: (ids kept per position, max |diff|, kept)
            model = nnx.merge(target.graphdef, state)
            positions = jnp.broadcast_to(jnp.arange(tokens_bt.shape[1]), tokens_bt.shape)
            hidden = model(tokens_bt, positions).hidden_bth
            full, out = model.logits(hidden), []
            for name, head_state in zip(names, head_states):
                got = nnx.merge(heads[name].graphdef, head_state).scores(hidden).logits
                kept = jnp.isfinite(got)
                out.append((kept.sum(-1), jnp.max(jnp.where(kept, jnp.abs(got - full), 0.0)), kept))
            return out

        shortlist = {}
        checks = head_check(target.state, [heads[n].state for n in names], tokens)
        for name, (kept, diff, where) in zip(names, checks):
            head = heads[name]
            outside = int(np.asarray(where)[..., np.setdiff1d(np.arange(target.cfg.vocab_size),
                                                               np.asarray(head.state["ids"].get_value()))].sum()
                          ) if name == "subset" else 0
            shortlist[name] = {"kept": sorted(set(np.asarray(kept).ravel().tolist())), "max_diff": float(diff),
                               "outside_subset": outside,
                               "rows_spec": str(head.state["rows"].get_value().sharding.spec)}
        engine = make_decoder("mtp", target, mtp=load_mtp(ckpt, target.cfg, "float32", mesh), mtp_steps=3,
                              draft_head=heads["subset"])
        spec_greedy = engine.generate(batch, NEW_TOKENS, stop_ids=[]).output_ids
    specs, devices = {}, {}
    for path, var in nnx.to_flat_state(target.state):
        name = ".".join(str(p) for p in path)
        specs[name] = str(var.get_value().sharding.spec)
        devices[name] = len(var.get_value().sharding.device_set)
    return {"logits": logits.tolist(), "greedy": greedy, "spec_greedy": spec_greedy, "shortlist": shortlist,
            "specs": specs, "devices": devices,
            "cache_specs": cache_specs, "mtp_specs": mtp_specs, "num_devices": int(mesh.devices.size)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("ckpts", nargs="+")
    parser.add_argument("--mesh", action="append", required=True)
    parser.add_argument("--mtp", default=None, help="a separate MTP head directory (e.g. a gemma4_assistant)")
    args = parser.parse_args()
    print(json.dumps({c: {m: run(c, m, args.mtp) for m in args.mesh} for c in args.ckpts}))


if __name__ == "__main__":
    main()
