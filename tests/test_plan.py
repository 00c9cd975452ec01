"""`plan`: a dry run compiles the very functions a run compiles. On `cpu:N` the planned numbers
must be those of a real compile-and-run of the same function; the verdict, the exit status and the
JSON keys are the contract of `infer.py plan`.

The TPU / GPU compilers are optional extras; `benchmarks/plan_sizing.py` runs the real configs on them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def planned_dmtp(tiny_qwen3_5_dir):
    from dmtp_jax.plan import plan_inference
    return plan_inference(tiny_qwen3_5_dir, method="dmtp", topology="cpu:1", batch_size=2, prompt_len=20,
                          max_new_tokens=16, dtype="float32")


def test_plan_matches_a_real_compile_and_run(tiny_qwen3_5_dir, planned_dmtp):
    """The planned round has the FLOPs and the memory of the round compiled from real weights and a
    real prefilled state, which then runs."""
    from dmtp_jax.checkpoint.dmtp_ckpt import init_fusion
    from dmtp_jax.checkpoint.dflash_ckpt import init_drafter
    from dmtp_jax.checkpoint.hf import load_target
    from dmtp_jax.checkpoint.mtp_ckpt import load_mtp
    from dmtp_jax.decode import make_decoder
    from dmtp_jax.decode.batch import pad_prompts
    from dmtp_jax.decode.sampling import SamplingParams
    from dmtp_jax.models.drafter_shape import default_drafter_config
    from dmtp_jax.plan.compile import cost_of

    target = load_target(tiny_qwen3_5_dir, "float32")
    dcfg = default_drafter_config(target.cfg)
    drafter = init_drafter(dcfg, "float32")
    decoder = make_decoder("dmtp", target, drafter, mtp=load_mtp(tiny_qwen3_5_dir, target.cfg, "float32"),
                           fusion=init_fusion("dmtp", dcfg.hidden_size, dcfg.rms_norm_eps, "float32"))
    batch = pad_prompts([[1] * 20, [2] * 20], 16, target.cfg.vocab_size, slack=decoder.slots)
    sp, key = SamplingParams.make(), jax.random.key(0)
    state = decoder.prefill(decoder.model_states(), batch.tokens_bt, batch.lengths_b,
                            decoder.new_state(2, batch.max_len), sp, key, greedy=True)
    active, limits = np.ones(2, bool), np.full(2, 40, np.int32)
    knobs = decoder.knobs()
    compiled = decoder.round.lower(decoder.model_states(), state, active, limits, sp, key, np.int32(1), knobs,
                                   greedy=True).compile()
    real_mem, real_cost = compiled.memory_analysis(), cost_of(compiled)
    planned = {f.name: f for f in planned_dmtp.functions}["round"]
    assert planned.flops == real_cost["flops"]
    assert planned.bytes_accessed == real_cost["bytes accessed"]
    assert planned.argument_bytes == real_mem.argument_size_in_bytes
    assert planned.temp_bytes == real_mem.temp_size_in_bytes
    assert planned.alias_bytes == real_mem.alias_size_in_bytes
    tokens = compiled(decoder.model_states(), state, active, limits, sp, key, np.int32(1), knobs)[1]
    assert np.asarray(tokens).shape == (2, decoder.slots)


def test_plan_accounts_weights_and_caches(planned_dmtp):
    """Per-device weights are the models' bytes; the minimum of a round is weights + caches."""
    p = planned_dmtp
    assert set(p.weight_bytes) == {"target", "drafter", "mtp", "fusion"}
    assert set(p.state_bytes) == {"target_cache", "mtp_cache", "ctx_cache"}
    rnd = {f.name: f for f in p.functions}["round"]
    # the drafter's context cache counts whole in memory; the cache here is shorter than its window
    assert rnd.min_bytes == pytest.approx(sum(p.weight_bytes.values()) + sum(p.state_bytes.values()), abs=1)
    assert rnd.argument_bytes >= sum(p.weight_bytes.values())
    assert p.fits and p.per_device_peak_bytes == max(f.peak_bytes for f in p.functions)
    assert rnd.calls == 16          # without --accept-len: one token per round, the upper bound


def test_plan_notes_the_deferred_rows_of_serve_auto(tiny_qwen3_5_dir, planned_dmtp):
    """The note's size (`deferred_nbytes`) is the bytes of the buffer `serve --method auto` builds over
    this method."""
    from dmtp_jax.checkpoint.hf import load_target
    from dmtp_jax.decode.drafting import DEFER_WINDOW, deferred_nbytes, deferred_widths, new_deferred
    from dmtp_jax.models.drafter_shape import default_drafter_config
    from dmtp_jax.sharding import make_mesh
    cfg = load_target(tiny_qwen3_5_dir, "float32").cfg
    widths = deferred_widths(cfg, default_drafter_config(cfg))
    buffer = new_deferred(make_mesh(None), 2, DEFER_WINDOW, *widths, np.float32)
    assert deferred_nbytes(2, DEFER_WINDOW, *widths, "float32") == sum(x.nbytes for x in jax.tree.leaves(buffer))
    assert any(f"of deferred rows per device ({DEFER_WINDOW} positions per row" in note for note in planned_dmtp.notes)


def test_cli_does_not_fit_exits_2_after_the_table(tiny_qwen3_dir, tmp_path, capsys):
    import infer
    out = tmp_path / "plan.json"
    rc = infer.main(["plan", "--target", os.path.join(tiny_qwen3_dir, "config.json"), "--method", "ar",
                     "--prompt-len", "8", "--max-new-tokens", "4", "--dtype", "float32", "--hbm-gb", "0.0001",
                     "--prefix-cache-gb", "0.5", "--json", str(out)])
    captured = capsys.readouterr()
    assert rc == 2
    assert "per-device peak" in captured.out and "decode_step" in captured.out
    assert "prefix cache (serve)" in captured.out and "+ prefix cache 0.50 GiB" in captured.out
    err = captured.err.strip().splitlines()[-1]
    assert err.startswith("error: does not fit 0.00 GiB per device:") and "needs" in err
    plan = json.loads(out.read_text())
    assert {"fits", "per_device_peak_bytes", "weight_bytes", "functions"} <= set(plan)
    assert plan["fits"] is False and plan["weight_bytes"]["target"] > 0
    # serve's prefix-cache budget is held besides the calls: a state line and part of the peak
    assert plan["state_bytes"]["prefix cache (serve)"] == plan["resident_bytes"] == 2**29
    assert plan["per_device_peak_bytes"] == max(f["peak_bytes"] for f in plan["functions"]) + 2**29
    for f in plan["functions"]:
        assert {"name", "compile_s", "peak_bytes", "flops", "bytes_accessed", "min_bytes", "estimated_s"} <= set(f)
        assert f["estimated_s"] is None         # the CPU compiler gives no time estimate


def test_cli_bad_input_is_one_line(tiny_qwen3_dir, tmp_path, capsys):
    import infer
    assert infer.main(["plan", "--target", str(tmp_path / "none.json")]) == 2
    assert capsys.readouterr().err.strip() == f"error: model directory not found: {tmp_path / 'none.json'}"
    assert infer.main(["plan", "--target", tiny_qwen3_dir, "--topology", "v9z:1x1"]) == 2
    assert capsys.readouterr().err.strip() == ("error: unknown TPU 'v9z' in 'v9z:1x1'; known: v4, v5e, v5p, v6e "
                                               "(e.g. v5p:2x2x2, v5e:4x4, v6e:2x4)")
    assert infer.main(["plan", "--target", tiny_qwen3_dir, "--prompt-len", "500", "--max-new-tokens", "100"]) == 2
    assert "exceeds the target's max_position_embeddings (512)" in capsys.readouterr().err


def test_cpu_mesh_of_two_devices(tiny_qwen3_dir, tmp_path):
    """`--topology cpu:2 --mesh tensor=2`: the weights split over two host devices (a fresh process:
    the CPU device count is fixed when JAX starts)."""
    out = tmp_path / "p.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "infer.py"), "plan", "--target", tiny_qwen3_dir,
                           "--method", "ar", "--topology", "cpu:2", "--mesh", "tensor=2", "--prompt-len", "8",
                           "--max-new-tokens", "4", "--dtype", "float32", "--json", str(out)],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(out.read_text())
    assert plan["num_devices"] == 2 and plan["mesh"]["tensor"] == 2 and plan["fits"]
    from dmtp_jax.checkpoint.hf import abstract_target
    from dmtp_jax.config import load_target_config
    _, abstract = abstract_target(load_target_config(tiny_qwen3_dir), "float32")
    one = sum(int(np.prod(x.shape)) * 4 for x in jax.tree.leaves(abstract))
    assert plan["weight_bytes"]["target"] < one         # split, not replicated


@pytest.mark.heavy
def test_exact_cost_counts_every_scanned_group(tmp_path):
    """XLA's cost analysis counts a loop body once; `exact_cost` reads FLOPs from an unrolled copy,
    so a target of two scanned groups reports about twice the layers' FLOPs, with the same memory."""
    from dmtp_jax.plan import plan_inference
    cfg = {"model_type": "qwen3_5_text", "vocab_size": 128, "hidden_size": 32, "intermediate_size": 64,
           "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
           "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
           "linear_value_head_dim": 8, "max_position_embeddings": 512, "eos_token_id": 127}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    kw = dict(method="ar", dtype="float32", prompt_len=32, max_new_tokens=8)
    scanned = {f.name: f for f in plan_inference(str(path), **kw).functions}["decode_step"]
    exact = {f.name: f for f in plan_inference(str(path), exact_cost=True, **kw).functions}["decode_step"]
    assert 1.5 * scanned.flops < exact.flops < 2.5 * scanned.flops
    assert exact.temp_bytes == scanned.temp_bytes and exact.argument_bytes == scanned.argument_bytes


def test_a_compiler_refusal_is_a_plan_that_does_not_fit():
    """The TPU compiler refuses a program over the chip's memory (RESOURCE_EXHAUSTED) before any
    memory analysis exists: `plan` reports it as does-not-fit (exit 2), other errors stay errors."""
    from dmtp_jax.plan.compile import compile_function
    from dmtp_jax.plan.compile import DoesNotFitError

    def refused():
        raise RuntimeError("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
                           "temporaries (105.47G) exceeds available HBM (95.74G).\nmore detail")

    with pytest.raises(DoesNotFitError, match=r"^does not fit: the compiler refused train_step: Ran out of "
                                              r"memory on HBM.*\(105\.47G\).*\(95\.74G\)\.$"):
        compile_function("train_step", refused, min_bytes=1)

    def broken():
        raise RuntimeError("INVALID_ARGUMENT: bad sharding")

    with pytest.raises(RuntimeError, match="INVALID_ARGUMENT"):
        compile_function("round", broken, min_bytes=1)


def test_plan_with_a_subset_draft_head_needs_no_counts(tiny_qwen3_5_dir):
    """`--draft-head efficient --draft-head-vocab N` plans without token counts: the head holds N
    (padded) columns of the factor, N rows and N ids."""
    from dmtp_jax.config import load_target_config
    from dmtp_jax.plan import plan_inference
    cfg = load_target_config(tiny_qwen3_5_dir)
    plan = plan_inference(tiny_qwen3_5_dir, method="mtp", topology="cpu:1", prompt_len=8, max_new_tokens=8,
                          dtype="float32", draft_head="efficient", draft_head_rank=4, draft_head_vocab=13)
    n, h = 16, cfg.hidden_size          # subset_size(13): 16
    assert plan.weight_bytes["draft_head"] == 4 * (h * 4 + 4 * n + n * h + n)
    assert plan.settings["draft head"] == "efficient(rank=4,shortlist=1,vocab=13)"


def test_plan_sizes_the_family_s_own_mtp_head(tmp_path):
    """`plan` (abstract models, nothing compiled) sizes each family's head: a Gemma 4 target's
    `gemma4_assistant` from `--mtp CONFIG.json` (no private cache), none without it (one error line);
    GLM-4.7-Flash's next-token layer is an MLA + MoE layer of the target's."""
    from gemma_fixtures import ASSISTANT, TINY
    from dmtp_jax.config import ConfigError
    from dmtp_jax.models.gemma4_assistant import AssistantConfig
    from dmtp_jax.plan.models import plan_models, shard_bytes
    from dmtp_jax.sharding import make_mesh

    target, assistant = tmp_path / "gemma.json", tmp_path / "assistant.json"
    target.write_text(json.dumps(dict(TINY, model_type="gemma4_text")))
    assistant.write_text(json.dumps({"model_type": "gemma4_assistant", "backbone_hidden_size": TINY["hidden_size"],
                                     "use_ordered_embeddings": True, "num_centroids": 8, "text_config": ASSISTANT}))
    mesh = make_mesh()
    models = plan_models(str(target), "dmtp", mesh, "float32", mtp_path=str(assistant))
    head = models["mtp"]
    assert isinstance(head.cfg, AssistantConfig) and head.cfg.cache_layers == 0 and head.model_dir == str(assistant)
    ha, h, v = ASSISTANT["hidden_size"], TINY["hidden_size"], TINY["vocab_size"]
    assert shard_bytes(head.state) > 4 * (v * ha + 2 * h * ha + ha * h + ha * 8) + 4 * v   # + its 2 layers
    with pytest.raises(ConfigError, match="gemma4_assistant"):
        plan_models(str(target), "mtp", mesh, "float32")
    glm = plan_models(os.path.join(ROOT, "configs", "models", "glm-4.7-flash.json"), "mtp", mesh, "bfloat16")["mtp"]
    shapes = {jax.tree_util.keystr(p): x.shape for p, x in jax.tree_util.tree_leaves_with_path(glm.state)}
    assert glm.cfg.cache_layers == 1
    assert shapes["['layers'][0]['self_attn']['kv_a_proj_with_mqa'].value"] == (2048, 512 + 64)   # the latent
    assert shapes["['layers'][0]['mlp']['gate_proj'].value"] == (64, 2048, 1536)                   # 64 experts
