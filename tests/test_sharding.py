"""The same forward and greedy decode on 8 fake CPU devices equals the single-device result.

`--xla_force_host_platform_device_count=8` must be set before jax is imported, so the runs happen in
subprocesses (`tests/sharded_forward_check.py`, one per checkpoint, in parallel); each computes the
1-device reference (`tensor=1`) and the sharded meshes in the same process, on the same inputs.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from gemma_fixtures import build_tiny_gemma4
from mla_fixtures import build as build_mla

HERE = os.path.dirname(os.path.abspath(__file__))
HELPER = os.path.join(HERE, "sharded_forward_check.py")
REFERENCE = "tensor=1"
# mesh -> the axis q_proj must be split on (None: replicated); `expert` also splits the MoE experts
# (expert parallelism) and, like data/fsdp, the batch, hence every cache (data-parallel attention)
MESHES = {"tensor=4,data=2": "tensor", "fsdp=8": "fsdp", "expert=4,tensor=2": "tensor", "expert=4": None}
# every mesh at least once and every family on two (each mesh is a few compiles in the family's
# process): tensor x data on the attention-only and hybrid models, fsdp on both Qwen3s, expert x
# tensor on the MoE, and a pure expert mesh (attention unsplit, the batch and every cache over
# `expert` alone) on the hybrid MoE. The default run keeps the hybrid MoE (MTP, speculative greedy,
# the efficient heads) on tensor x data and expert: one process; `-m heavy` runs the rest.
HEAVY = pytest.mark.heavy
CASES = [("tiny_qwen3_5_moe_dir", "tensor=4,data=2"), ("tiny_qwen3_5_moe_dir", "expert=4"),
         pytest.param("tiny_qwen3_dir", "tensor=4,data=2", marks=HEAVY),
         pytest.param("tiny_qwen3_dir", "fsdp=8", marks=HEAVY),
         pytest.param("tiny_qwen3_moe_dir", "expert=4,tensor=2", marks=HEAVY),
         pytest.param("tiny_qwen3_moe_dir", "fsdp=8", marks=HEAVY),
         # Gemma 4 (packed sliding / full cache split over tensor, the assistant as the MTP head) and
         # MLA (the latent cache whole on every tensor shard, split over the batch axes)
         pytest.param("tiny_gemma4_dirs", "tensor=4,data=2", marks=HEAVY),
         pytest.param("tiny_deepseek_v3_dir", "tensor=4,data=2", marks=HEAVY),
         pytest.param("tiny_deepseek_v3_dir", "expert=4,tensor=2", marks=HEAVY)]
# the families carrying an MTP head (speculative greedy is checked on them), and their attention's
# query projection
WITH_MTP = ("tiny_qwen3_5_moe_dir", "tiny_gemma4_dirs", "tiny_deepseek_v3_dir")
Q_PROJ = {"tiny_qwen3_5_moe_dir": "stacks.1.0.self_attn.q_proj",
          "tiny_deepseek_v3_dir": "stacks.0.0.self_attn.q_b_proj"}
# 8 fake devices, added to the run's XLA_FLAGS (conftest's LLVM -O0: the 1-device reference is
# compiled with the same flags).
FLAGS = "--xla_force_host_platform_device_count=8"


@pytest.fixture(scope="module")
def tiny_gemma4_dirs(tmp_path_factory) -> tuple[str, str]:
    """The tiny Gemma 4 target's directory and its assistant's (`tests/gemma_fixtures.py`)."""
    dirs = str(tmp_path_factory.mktemp("gemma4")), str(tmp_path_factory.mktemp("gemma4_assistant"))
    build_tiny_gemma4(*dirs)
    return dirs


@pytest.fixture(scope="module")
def tiny_deepseek_v3_dir(tmp_path_factory) -> str:
    """A tiny DeepSeek-V3 with its next-token layer (`tests/mla_fixtures.py`)."""
    d = str(tmp_path_factory.mktemp("deepseek_v3"))
    build_mla("deepseek_v3", d, seed=11)
    return d


@pytest.fixture(scope="module")
def sharded_runs(request) -> dict:
    """`{fixture name: {mesh spec: helper output}}` for the cases this run selected, one process per
    checkpoint, run concurrently (a fixture of two directories: a target and its separate MTP head)."""
    flags = (os.environ.get("XLA_FLAGS", "") + " " + FLAGS).strip()
    path = os.pathsep.join(filter(None, [os.path.dirname(HERE), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "XLA_FLAGS": flags, "PYTHONPATH": path, "JAX_PLATFORMS": "cpu"}
    selected: dict[str, list[str]] = {}
    for item in request.session.items:
        params = getattr(item, "callspec", None) and item.callspec.params
        if getattr(item, "module", None) is request.module and params and "mesh" in params:
            meshes = selected.setdefault(params["family"], [REFERENCE])
            meshes += [params["mesh"]] if params["mesh"] not in meshes else []
    procs = {}
    for name, meshes in selected.items():
        dirs = request.getfixturevalue(name)
        ckpt = [dirs] if isinstance(dirs, str) else [dirs[0], "--mtp", dirs[1]]
        procs[name] = subprocess.Popen([sys.executable, HELPER, *ckpt, *(a for m in meshes for a in ("--mesh", m))],
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    runs = {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=900)   # two processes of 8 fake devices on a loaded 2-core machine
        assert proc.returncode == 0, f"{name}: helper failed:\n{err[-4000:]}"
        runs[name] = next(iter(json.loads(out.strip().splitlines()[-1]).values()))
    return runs


def mesh_devices(mesh: str) -> int:
    return int(np.prod([int(part.split("=")[1]) for part in mesh.split(",")]))


@pytest.mark.parametrize("family, mesh", CASES)
def test_sharded_matches_single_device(sharded_runs, family, mesh):
    ref, run = sharded_runs[family][REFERENCE], sharded_runs[family][mesh]
    assert ref["num_devices"] == 1 and run["num_devices"] == mesh_devices(mesh)
    ref_logits, logits = np.asarray(ref["logits"]), np.asarray(run["logits"])
    assert logits.shape == ref_logits.shape == (8, 40, 128)
    diff = float(np.max(np.abs(logits - ref_logits)))
    # The hybrid's DeltaNet (l2-normalised q/k, delta-rule recurrence) amplifies fp32 reduction-order
    # noise more than plain attention: seen 4e-5..8e-5 on every mesh (1e-4 relative, as in compare);
    # MLA and Gemma 4 (soft-capped): up to 8e-6 on logits of 4.6
    tol = 1e-4 * max(1.0, float(np.abs(ref_logits).max())) if family in WITH_MTP else 1e-5
    assert diff <= tol, f"{family} on {mesh}: max |logit diff| {diff:.3e}"
    assert run["greedy"] == ref["greedy"]
    assert all(len(g) == 5 for g in run["greedy"])
    assert run["spec_greedy"] == (ref["greedy"] if family in WITH_MTP else None)
    if run["shortlist"]:     # the efficient heads: 8 ids per position over all shards, exact
        for head in run["shortlist"].values():
            assert head["kept"] == [8] and head["max_diff"] <= 1e-4 and head["outside_subset"] == 0, head
            assert ("tensor" in head["rows_spec"]) == ("tensor" in mesh), head


@pytest.mark.parametrize("family, mesh", CASES)
def test_params_are_sharded(sharded_runs, family, mesh):
    run, axis = sharded_runs[family][mesh], MESHES[mesh]
    hybrid = family == "tiny_qwen3_5_moe_dir"
    # scanned layer stacks (`models/layer_stack.py`): the hybrid's 4 layers are 3 DeltaNet layers
    # scanned (stack 0) and one attention layer (stack 1); a Qwen3's layers are one stack
    q_proj = Q_PROJ.get(family, "stacks.0.0.self_attn.q_proj")
    assert (axis or "P()") in run["specs"][q_proj], run["specs"][q_proj]
    assert run["devices"][q_proj] == mesh_devices(mesh)
    if family == "tiny_gemma4_dirs":     # the full layers (own head dim) and the assistant split their heads too
        assert axis in run["specs"]["stacks.0.1.self_attn.q_proj"]
        assert axis in run["mtp_specs"]["layers.1.self_attn.q_proj"]
    # the cache's heads: Gemma's packed heads split over tensor (2 packed heads repeated to 4 on tensor=4),
    # MLA's one latent head whole on every tensor shard
    cache_split = family != "tiny_deepseek_v3_dir" and "tensor" in mesh
    assert all(("tensor" in spec) == cache_split for path, spec in run["cache_specs"].items()
               if path.startswith("kv.")), run["cache_specs"]
    assert all(spec == "P()" for spec in sharded_runs[family][REFERENCE]["specs"].values())
    if hybrid:
        assert (axis or "P()") in run["specs"]["stacks.0.0.linear_attn.in_proj_qkv"]
    if family in ("tiny_qwen3_moe_dir", "tiny_qwen3_5_moe_dir", "tiny_deepseek_v3_dir"):
        moe = "stacks.0.1.mlp.gate_proj" if family == "tiny_deepseek_v3_dir" else "stacks.0.0.mlp.gate_proj"
        if axis:
            assert axis in run["specs"][moe]   # stacked experts [G, E, H, I]
        assert ("expert" in run["specs"][moe]) == ("expert" in mesh)
    # every cache array (K/V, DeltaNet conv and recurrent states) splits its batch (8 rows) over the
    # batch axes, `expert` included; nothing is replicated over a batch axis of the mesh
    batch_axes = [a.split("=")[0] for a in mesh.split(",") if a.split("=")[0] in ("data", "fsdp", "expert")]
    assert run["cache_specs"], run
    for path, spec in run["cache_specs"].items():
        assert all(a in spec for a in batch_axes), (path, spec)
    assert len(run["cache_specs"]) == (4 if hybrid else 2), run["cache_specs"]   # K, V (+ conv, state)
