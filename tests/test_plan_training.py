"""`train.py plan`: the train step compiled on abstract weights; the frozen target, the drafter's
params and the optimizer are accounted apart, and they are what the step takes as arguments."""

from __future__ import annotations

import json


def test_train_plan_cli_json(tiny_qwen3_dir, tmp_path, capsys):
    import train
    out = tmp_path / "train_plan.json"
    rc = train.main(["plan", "--target", tiny_qwen3_dir, "--method", "dflash", "--batch-size", "2", "--seq-len",
                     "32", "--draft-layers", "1", "--target-dtype", "float32", "--compute-dtype", "float32",
                     "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0 and "train_step" in text and "optimizer" in text
    plan = json.loads(out.read_text())
    assert plan["kind"] == "training" and plan["fits"]
    assert set(plan["weight_bytes"]) == {"target (frozen)"}
    assert set(plan["state_bytes"]) == {"drafter params (fp32)", "optimizer"}
    # AdamW holds two moments of every fp32 param
    assert plan["state_bytes"]["optimizer"] >= 2 * plan["state_bytes"]["drafter params (fp32)"]
    (step,) = plan["functions"]
    args = sum(plan["weight_bytes"].values()) + sum(plan["state_bytes"].values())
    assert step["argument_bytes"] >= args and step["flops"] > 0 and step["tokens_per_call"] == 64


def test_train_plan_bad_input(tiny_qwen3_dir, capsys):
    import train
    assert train.main(["plan", "--target", tiny_qwen3_dir, "--batch-size", "3", "--grad-accum", "2",
                       "--method", "dflash"]) == 2
    assert capsys.readouterr().err.strip() == "error: --batch-size 3 is not a multiple of --grad-accum 2"


def test_head_factor_plan_cli_json(mtp_target_dir, tmp_path, capsys):
    """`train.py plan --job head-factor`: the factor step compiled on abstract weights, the frozen
    target and MTP head apart from the fp32 factor (over the padded subset) and its AdamW state."""
    import train
    from dmtp_jax.config import load_target_config
    from dmtp_jax.models.draft_head import subset_size
    out = tmp_path / "factor_plan.json"
    rc = train.main(["plan", "--job", "head-factor", "--target", mtp_target_dir, "--batch-size", "2", "--seq-len",
                     "32", "--target-dtype", "float32", "--rank", "4", "--vocab", "40", "--ce-chunk", "8",
                     "--json", str(out)])
    assert rc == 0 and "head_factor_step" in capsys.readouterr().out
    plan = json.loads(out.read_text())
    assert set(plan["weight_bytes"]) == {"target (frozen)", "mtp (frozen)"}
    hidden = load_target_config(mtp_target_dir).hidden_size
    assert plan["state_bytes"]["factor (fp32)"] == 4 * (hidden * 4 + 4 * subset_size(40))
    assert plan["state_bytes"]["optimizer"] >= 2 * plan["state_bytes"]["factor (fp32)"]
    assert plan["settings"]["vocab"] == 40 and plan["settings"]["rank"] == 4
    (step,) = plan["functions"]
    assert step["argument_bytes"] >= sum(plan["weight_bytes"].values()) and step["tokens_per_call"] == 2 * 33
