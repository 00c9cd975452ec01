"""Hybrid Qwen3.5 / Qwen3.6 targets (Gated DeltaNet + gated attention, dense and MoE, native MTP):
numerics against transformers, the image-text layout, and every decoding method on them.

The tiny checkpoints (`tiny_qwen3_5_dir`, `tiny_qwen3_5_moe_dir` in conftest) have perturbed
zero-centred norms, partial rotary, a 300-token prompt in `compare` (longer than one DeltaNet chunk),
and batches of rows of different lengths throughout.
"""

import jax
import numpy as np
import pytest

from dflash_fixtures import build_reference_drafter, randomized
from stat_checks import assert_matches_target_joint
from test_mtp_dmtp import PROMPTS
from dmtp_jax.checkpoint.dmtp_ckpt import load_dmtp_drafter, save_dmtp_drafter
from dmtp_jax.checkpoint.hf import load_target
from dmtp_jax.checkpoint.mtp_ckpt import load_mtp
from dmtp_jax.decode import make_decoder
from dmtp_jax.decode.ar import ARDecoder
from dmtp_jax.decode.sampling import SamplingParams
from dmtp_jax.methods import DMTP_METHODS

HYBRID_CHECKS = ("logits", "argmax_agreement", "hidden_layer_0", "hidden_layer_3", "cached_decode",
                 "deltanet_state", "greedy_continuation", "mtp", "mtp_cache")


@pytest.fixture(scope="module")
def tiny_qwen3_next_dir(tmp_path_factory) -> str:
    from conftest import build_tiny_checkpoint
    return build_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny-qwen3_next")), "qwen3_next", seed=6)


@pytest.mark.parametrize("fixture", ["tiny_qwen3_5_dir", pytest.param("tiny_qwen3_5_moe_dir", marks=pytest.mark.heavy),
                                     pytest.param("tiny_qwen3_next_dir", marks=pytest.mark.heavy)])
def test_compare_hybrid_against_transformers(fixture, request):
    """fp32 logits and per-layer hidden states within 1e-4 (relative) of transformers, cached decode
    equal to the full forward, DeltaNet states after a prefill equal to transformers' cache, greedy
    `ar` equal to `generate` on a batch of 7-, 33- and 300-token prompts, MTP equal to `MtpModel`."""
    from dmtp_jax.compare import compare_target

    report = compare_target(request.getfixturevalue(fixture))
    by_name = {c["name"]: c for c in report["checks"]}
    assert set(HYBRID_CHECKS) <= set(by_name), sorted(by_name)
    assert report["ok"], [c for c in report["checks"] if not c["ok"]]
    assert by_name["greedy_continuation"]["max_abs_diff"] == 0
    assert by_name["deltanet_state"]["max_abs_diff"] < 1e-4


def test_image_text_layout_gives_text_logits(tiny_qwen3_5_moe_dir, tmp_path):
    """`model.language_model.*` + `model.visual.*`, fused experts, two shards, nested text_config:
    the same target and MTP head as the text-only save."""
    from conftest import to_image_text_layout
    from dmtp_jax.compare.forward import jax_forward

    vlm_dir = to_image_text_layout(tiny_qwen3_5_moe_dir, str(tmp_path / "vlm"))
    text, vlm = load_target(tiny_qwen3_5_moe_dir), load_target(vlm_dir)
    assert vlm.cfg == text.cfg
    tokens = np.asarray([PROMPTS[2]], np.int32)
    assert np.array_equal(jax_forward(vlm, tokens)["logits"], jax_forward(text, tokens)["logits"])
    a, b = load_mtp(tiny_qwen3_5_moe_dir, text.cfg), load_mtp(vlm_dir, vlm.cfg)
    assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a.state), jax.tree.leaves(b.state)))


@pytest.fixture(scope="module")
def hybrid(tiny_qwen3_5_dir, tmp_path_factory):
    """The dense hybrid target, its MTP head, and drafter directories: DFlash, DFlash2 and one DMTP
    directory per method (random non-zero fusions)."""
    target = load_target(tiny_qwen3_5_dir)
    mtp = load_mtp(tiny_qwen3_5_dir, target.cfg)
    root = tmp_path_factory.mktemp("hybrid-drafters")
    dflash = str(root / "dflash")
    build_reference_drafter(dflash, seed=3, layer_types=("sliding_attention", "full_attention"), sliding_window=6)
    dflash2 = str(root / "dflash2")
    build_reference_drafter(dflash2, version=2, seed=5, is_causal=False)
    dmtp = {}
    for i, method in enumerate(DMTP_METHODS):
        drafter, fusion = load_dmtp_drafter(dflash, target.cfg, method)
        dmtp[method] = str(root / method)
        save_dmtp_drafter(drafter, randomized(fusion, i), dmtp[method])
    return {"target": target, "mtp": mtp, "dflash": dflash, "dflash2": dflash2, "dmtp": dmtp}


def hybrid_engine(method, hybrid, **options):
    from dmtp_jax.checkpoint.dflash_ckpt import load_drafter

    target, mtp = hybrid["target"], hybrid["mtp"]
    if method == "mtp":
        return make_decoder("mtp", target, None, mtp=mtp, **options)
    if method in ("dflash", "dflash2"):
        return make_decoder("dflash", target, load_drafter(hybrid[method], target.cfg), **options)
    drafter, fusion = load_dmtp_drafter(hybrid["dmtp"][method], target.cfg)
    return make_decoder(method, target, drafter, mtp=mtp, fusion=fusion, **options)


@pytest.fixture(scope="module")
def hybrid_ar(hybrid):
    return ARDecoder(hybrid["target"]).generate(PROMPTS, 20, stop_ids=[]).output_ids


@pytest.mark.parametrize("method", [m if m in ("mtp", "dflash", "dmtp", "dmtp-adaptive")     # the rest: heavy
                                    else pytest.param(m, marks=pytest.mark.heavy)
                                    for m in ["mtp", "dflash", "dflash2", *DMTP_METHODS]])
def test_hybrid_greedy_equals_ar_for_every_method(method, hybrid, hybrid_ar):
    """Rejected drafts never reach a DeltaNet state: every method's greedy output equals `ar` on a
    batch of 4 rows of different lengths, with partial acceptance, and the round compiles once."""
    engine = hybrid_engine(method, hybrid)
    res = engine.generate(PROMPTS, 20, stop_ids=[])
    assert res.output_ids == hybrid_ar
    hist = res.stats["histogram"]
    assert hist[0] > 0 and sum(hist[1:]) > 0, f"acceptance should be partial, got {hist}"
    assert engine.compile_counts() == {"prefill": 1, "round": 1}


def test_hybrid_committed_state_equals_a_fresh_prefill(hybrid):
    """After speculative rounds, each row's DeltaNet states equal those of one prefill over the
    committed text (the snapshot the next round starts from is the accepted prefix's)."""
    from dmtp_jax.compare.forward import prefill_logits
    from dmtp_jax.decode.caches import TargetCaches

    target = hybrid["target"]
    engine = hybrid_engine("dmtp", hybrid)
    res = engine.generate(PROMPTS, 20, stop_ids=[])
    st = engine.last_state
    for row, (prompt, out) in enumerate(zip(PROMPTS, res.output_ids)):
        committed = (prompt + out)[:int(st.lengths_b[row])]
        cache = TargetCaches(target).new(1, st.target_cache.max_len)
        _, cache = prefill_logits(target.graphdef, target.state, np.asarray([committed], np.int32),
                                  np.asarray([len(committed)], np.int32), cache)
        for got, want in ((st.target_cache.conv_lbwc, cache.conv_lbwc), (st.target_cache.ssm_lbhkv, cache.ssm_lbhkv)):
            assert np.abs(np.asarray(got[:, row]) - np.asarray(want[:, 0])).max() < 1e-4


@pytest.mark.heavy
def test_hybrid_sampled_dmtp_is_lossless(hybrid):
    engine = hybrid_engine("dmtp", hybrid, mtp_steps=3)
    assert_matches_target_joint(engine, hybrid["target"], PROMPTS[0], SamplingParams.make(temperature=1.0, top_k=3))


@pytest.mark.heavy
def test_hybrid_regen_train_export_decode(tiny_qwen3_5_dir, tmp_path):
    """`train.py regen | train | export` on a hybrid target: the target writes the data, DMTP trains
    on frozen features computed in the chunked DeltaNet form (64-token sequences), the export loads
    and greedy dmtp equals `ar`."""
    from train_fixtures import tiny_train_config, write_regen_data
    from dmtp_jax.train.export import export_run
    from dmtp_jax.train.run import run_training

    data = write_regen_data(tiny_qwen3_5_dir, str(tmp_path / "regen.jsonl"), n=8, max_new_tokens=56)
    cfg = tiny_train_config(tiny_qwen3_5_dir, data, str(tmp_path / "run"), method="dmtp", steps=6,
                            batch_size=4, checkpoint_every=6)
    summary = run_training(cfg)
    assert summary["steps_run"] == 6 and summary["compile_count"] == 1
    out = str(tmp_path / "exported")
    export_run(cfg.out, out)
    target = load_target(tiny_qwen3_5_dir)
    drafter, fusion = load_dmtp_drafter(out, target.cfg)
    engine = make_decoder("dmtp", target, drafter, mtp=load_mtp(tiny_qwen3_5_dir, target.cfg), fusion=fusion)
    prompts = [[5, 9, 31, 4], [77, 2]]
    assert engine.generate(prompts, 12, stop_ids=[]).output_ids == \
        ARDecoder(target).generate(prompts, 12, stop_ids=[]).output_ids
