"""Training end to end on the tiny target: the loss falls, the step compiles once, the trained
drafter accepts more than the untrained one, and the export reloads in JAX and in `dflash`."""

import numpy as np
import pytest

from train_fixtures import tiny_train_config, write_regen_data


@pytest.fixture(scope="module")
def trained(tiny_qwen3_dir, tmp_path_factory):
    from dmtp_jax.train.run import run_training
    tmp = tmp_path_factory.mktemp("train-learn")
    data = write_regen_data(tiny_qwen3_dir, str(tmp / "regen.jsonl"), n=32)
    cfg = tiny_train_config(tiny_qwen3_dir, data, str(tmp / "run"), steps=60)
    summary = run_training(cfg)
    return tmp, data, cfg, summary


def test_loss_falls_and_one_compile(trained):
    _, _, _, summary = trained
    losses = summary["losses"]
    assert summary["steps_run"] == 60
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.5, (losses[:5], losses[-5:])
    assert summary["records"][-1]["acc"] > summary["records"][0]["acc"]
    assert summary["compile_count"] == 1


def test_export_reloads_in_jax_and_dflash(trained, tiny_qwen3_dir):
    import jax
    import torch
    from dflash.model import DFlashDraftModel
    from dmtp_jax.checkpoint.dflash_ckpt import load_drafter
    from dmtp_jax.checkpoint.hf import export_tensors, load_target
    from dmtp_jax.checkpoint.dflash_ckpt import DFLASH_NAME_RULES
    from dmtp_jax.train.export import export_run
    from dmtp_jax.train.checkpoints import restore_params

    tmp, _, cfg, _ = trained
    out = str(tmp / "exported")
    assert export_run(cfg.out, out)["step"] == 60
    target = load_target(tiny_qwen3_dir)
    loaded = load_drafter(out, target.cfg)
    params, _ = restore_params(cfg.out, loaded.cfg)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(loaded.state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    ref = DFlashDraftModel.from_pretrained(out, torch_dtype=torch.float32)
    ours = export_tensors(params["drafter"], rules=DFLASH_NAME_RULES)
    theirs = {k: v.detach().numpy() for k, v in ref.state_dict().items() if not k.endswith("inv_freq")}
    assert set(ours) == set(theirs)
    for k in ours:
        np.testing.assert_array_equal(ours[k], theirs[k], err_msg=k)


def test_trained_drafter_accepts_more(trained, tiny_qwen3_dir):
    import json
    from dmtp_jax.checkpoint.dflash_ckpt import init_drafter, load_drafter
    from dmtp_jax.checkpoint.hf import load_target
    from dmtp_jax.decode import make_decoder

    tmp, data, cfg, _ = trained
    out = str(tmp / "exported-acc")
    from dmtp_jax.train.export import export_run
    export_run(cfg.out, out)
    target = load_target(tiny_qwen3_dir)
    trained_d = load_drafter(out, target.cfg)
    untrained = init_drafter(trained_d.cfg, seed=0)
    recs = [json.loads(line) for line in open(data)][:8]
    prompts = [r["input_ids"][:r["loss_mask"].index(1)] for r in recs]
    acc = {}
    for name, d in (("untrained", untrained), ("trained", trained_d)):
        res = make_decoder("dflash", target, d).generate(prompts, 48, stop_ids=[])
        acc[name] = res.stats["per_verify_acceptance_length"]
    assert acc["trained"] > acc["untrained"] + 0.15, acc


@pytest.mark.heavy
def test_dmtp_from_a_dflash_drafter_trains_exports_and_decodes(trained, mtp_target_dir):
    """`--method dmtp --init-from DFLASH_DIR`: the fusion starts at zero and learns; the export is a
    DFlash directory plus `fusion.*` + `dmtp_config` that the engine loads; greedy dmtp == ar."""
    import jax
    from dmtp_jax.checkpoint.dmtp_ckpt import load_dmtp_drafter
    from dmtp_jax.checkpoint.hf import load_target
    from dmtp_jax.checkpoint.mtp_ckpt import load_mtp
    from dmtp_jax.decode import make_decoder
    from dmtp_jax.train.export import export_run
    from dmtp_jax.train.run import run_training
    tmp, data, cfg, _ = trained
    dflash_dir = str(tmp / "exported-for-dmtp")
    export_run(cfg.out, dflash_dir)
    run = tiny_train_config(mtp_target_dir, data, str(tmp / "dmtp-run"), method="dmtp", steps=12,
                            init_from=dflash_dir, checkpoint_every=12)
    summary = run_training(run)
    assert summary["steps_run"] == 12 and summary["compile_count"] == 1
    out = str(tmp / "dmtp-exported")
    export_run(run.out, out)
    target = load_target(mtp_target_dir)
    drafter, fusion = load_dmtp_drafter(out, target.cfg)
    assert fusion.cfg["method"] == "dmtp"
    assert max(float(abs(x).max()) for x in jax.tree.leaves(fusion.state) if x.ndim == 2) > 0
    prompts = [[5, 9, 31, 4], [77, 2]]
    engine = make_decoder("dmtp", target, drafter, mtp=load_mtp(mtp_target_dir, target.cfg), fusion=fusion)
    ar = make_decoder("ar", target).generate(prompts, 12, stop_ids=[]).output_ids
    assert engine.generate(prompts, 12, stop_ids=[]).output_ids == ar
