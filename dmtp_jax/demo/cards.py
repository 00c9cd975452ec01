"""Model cards (`README.md`) of the shipped demo directories, written from the runs' own records
(`python -m dmtp_jax.demo.cards --work-dir demo_out --runs demo_out/runs --demo demo`)."""

from __future__ import annotations

import argparse
import json
import os

LICENCE = ("Licence: the training text is the CPython standard library source (Python Software "
           "Foundation License); the tokenizer, the weights derived from it and the prompts in "
           "`demo/prompts.jsonl` are shared under the same PSF terms. The code that trained them is "
           "the repository's (Apache-2.0).")


def _fmt(x, spec=".3f"):
    return "-" if x is None else format(x, spec)


def target_card(summary: dict, distil: dict | None = None) -> str:
    """The target's card from `target_run/summary.json` (and the MTP-only phase's
    `mtp_run/summary.json`).

    Example:
        >>> target_card({"steps": 1, "train_seconds": 2.0, "last": {}, "held_out_eval": {}, "params": 3,
        ...              "mtp_params": 1, "data": {}}).splitlines()[0]
        '# demo/target: a miniature Qwen3.6 (Qwen3.5-format hybrid) pretrained on the Python stdlib, with its native MTP head'
    """
    d, last, ev = summary.get("data", {}), summary.get("last") or {}, summary.get("held_out_eval", {})
    lines = [
        "# demo/target: a miniature Qwen3.6 (Qwen3.5-format hybrid) pretrained on the Python stdlib, "
        "with its native MTP head",
        "",
        f"`Qwen3_5ForCausalLM` format, {summary['params'] / 1e6:.2f} M parameters: 4 layers (Gated DeltaNet, Gated "
        "DeltaNet, Gated DeltaNet, gated attention), hidden 256, dense SwiGLU MLP 768, tied embeddings, zero-centred "
        "norms, partial RoPE (0.25 of head_dim 64). Plus the native MTP head (`mtp.*`, "
        f"{summary['mtp_params'] / 1e6:.2f} M: one gated-attention layer, fc, three norms). Weights bf16.",
        "",
        f"Data: {d.get('train_files', '?')} stdlib modules of CPython ({d.get('train_bytes', 0) / 1e6:.1f} MB, "
        f"{d.get('train_tokens', 0) / 1e6:.2f} M tokens, byte-level BPE of 4096 tokens trained on the same "
        "text); test directories and 30 held-out modules excluded (`dmtp_jax/demo/corpus.py`).",
        "",
        f"Pretraining: {summary['steps']} steps x 16 windows x 256 tokens, AdamW, loss = main CE + 0.3 x MTP CE "
        "(MTP gradients flowing into the trunk, DeepSeek-V3 style), "
        f"{summary['train_seconds'] / 60:.1f} min on 2 CPU cores (`configs/demo_target.py`).",
        f"Last step: main CE {_fmt(last.get('main_ce'))}, MTP CE {_fmt(last.get('mtp_ce'))}. Held-out modules: "
        f"main CE {_fmt(ev.get('main_ce'))} (top-1 {_fmt(ev.get('main_acc'))}), MTP CE {_fmt(ev.get('mtp_ce'))} "
        f"(top-1 {_fmt(ev.get('mtp_acc'))}).",
    ]
    if distil:
        cfg = distil.get("config", {})
        hev = distil.get("held_out_eval", {})
        corpus, distilled = hev.get("corpus_head", {}), hev.get("distilled_head", {})
        lines += [
            "",
            "MTP-only phase (`configs/demo_mtp.py`, `train.py distil-mtp`): the target frozen, the head -- as "
            "pretraining left it, kept in `demo/mtp_corpus` -- trained to match the target's own next-token "
            "distribution (soft cross-entropy to softmax of the target's logits) on text the target wrote: its "
            "greedy answers to training-module prompts, the drafters' 1595 plus 3000 more "
            f"({distil.get('stream_tokens', 0) / 1e3:.0f} k tokens); {distil.get('steps', '?')} steps x "
            f"{cfg.get('batch_size', 16)} windows x {cfg.get('seq_len', 256)} tokens, lr {cfg.get('lr', '?')}, "
            f"{distil.get('train_seconds', 0) / 60:.1f} min.",
            f"Agreement of the head's top-1 with the target's top-1 on held-out modules (human-written text): "
            f"corpus-only head {_fmt(corpus.get('agree'))}, distilled head {_fmt(distilled.get('agree'))} "
            f"(KL {_fmt(corpus.get('kl'))} -> {_fmt(distilled.get('kl'))}).",
        ]
    lines += [
        "",
        "It writes Python-flavoured text (keywords, indentation, `self.` chains, docstring-like comments), "
        "often repetitive under greedy decoding, never correct programs: a model for demonstrating the "
        "decoding methods on a CPU, not a code model.",
        "",
        LICENCE, ""]
    return "\n".join(lines)


def drafter_card(name: str, run_dir: str, method_text: str, calibration: str | None = None) -> str:
    """A drafter's card from its run directory (`run_config.json`, `metrics.jsonl`, and for
    dmtp-adaptive `calibration.json`)."""
    with open(os.path.join(run_dir, "run_config.json")) as fh:
        cfg = json.load(fh)["train"]
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        recs = [json.loads(line) for line in fh if line.strip()]
    last = recs[-1] if recs else {}
    tail = recs[-20:]
    mean = (lambda k: sum(r[k] for r in tail) / len(tail)) if tail else (lambda k: None)
    seconds = sum(r.get("step_s", 0.0) for r in recs)
    head = cfg.get("mtp") or "the target's own (distilled) MTP head"
    eagle3 = cfg["method"] == "eagle3"
    layout = (f"one Llama-style layer (`LlamaForCausalLMEagle3`, the published EAGLE-3 layout) over the concatenated "
              f"outputs of target layers {cfg['target_layer_ids']}, a chain of {cfg['block_size'] - 1} drafts per "
              "round. Weights bf16; the embedding is the target's, the LM head its own (draft vocabulary = the "
              "target's)." if eagle3 else
              f"{cfg['draft_layers']} layers, block {cfg['block_size']} ({cfg['block_size'] - 1} candidates), "
              f"context from target layers {cfg['target_layer_ids']}. Weights bf16; embedding and LM head are the "
              "target's." + (f" Trained and run with MTP head: {head}." if cfg["method"] != "dflash" else ""))
    recipe = (f"training-time test: the drafter unrolled on its own outputs for {cfg['block_size'] - 1} passes, pass "
              "k weighted 0.8^k" if eagle3 else f"{cfg['num_anchors']} anchors")
    lines = [
        f"# demo/{name}: {method_text}",
        "",
        f"Drafter for `demo/target`: {layout}",
        "",
        "Data: the target's greedy continuations (64 new tokens) of 1595 prompts from the training modules "
        "(`demo/regen.jsonl`, `train.py regen`); the held-out modules are never seen. Every demo drafter has "
        "the same data, steps and hyper-parameters (`configs/demo_dflash.py` `SHARED`).",
        "",
        f"Training (method `{cfg['method']}`): {last.get('step', '?')} steps x {cfg['batch_size']} sequences x "
        f"{cfg['seq_len']} tokens, {recipe}, lr {cfg['lr']}, {seconds / 60:.1f} min on 2 CPU "
        f"cores. Final loss {_fmt(last.get('loss'))} (mean of the last 20 steps {_fmt(mean('loss'))}).",
    ]
    if last.get("step", cfg["steps"]) < cfg["steps"]:
        lines += ["", f"Stopped after step {last['step']} of the {cfg['steps']} the others had (`--resume` continues "
                  "the run): it has had fewer steps than the other drafters."]
    if cfg.get("init_from"):
        lines += ["", f"Initialised from `{cfg['init_from']}` (drafter and fusion, after its own "
                  f"{cfg['steps']} steps): these steps come on top of that drafter's."]
    if cfg["method"] == "dmtp-adaptive":
        lines += ["", "Both blocks at every anchor: DMTP mode (MTP's T1 fused, T1 unsupervised) and DFlash mode "
                  "(T1 slot MASK, T1 supervised), so a step runs the drafter over twice the blocks."]
        if calibration and os.path.isfile(calibration):
            with open(calibration) as fh:
                cal = json.load(fh)
            lines += [f"Threshold {cal['threshold']:.2f} on the MTP's top-1 probability, calibrated with "
                      f"`train.py calibrate` on {cal['anchors']} anchors of target-written training text "
                      f"(`demo_out/calibration.jsonl`, 200 more training-module prompts): expected tokens per verify "
                      f"{cal['tokens_per_verify']:.3f} (always MTP's T1 {cal['always_mtp']:.3f}, never "
                      f"{cal['never_mtp']:.3f}); MTP's T1 in {cal['mtp_fraction']:.0%} of rounds."]
    return "\n".join(lines + ["", LICENCE, ""])


DRAFTERS = {
    "dflash": "a DFlash block-diffusion drafter",
    "dmtp": "a DMTP drafter (DFlash + T1 fusion, main variant `dmtp`)",
    "dmtp_adaptive": "a dmtp-adaptive drafter (one drafter, MTP's T1 or its own per row)",
    "dmtp_corpus": "a DMTP drafter trained with the corpus-only MTP head (the weak-head case)",
    "dmtp_adaptive_corpus": "a dmtp-adaptive drafter trained with the corpus-only MTP head",
    "eagle3": "an EAGLE-3 drafter (the baseline for a target without native MTP)",
}


def main(argv=None) -> int:
    """`python -m dmtp_jax.demo.cards`: `write_cards` from the command line."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--work-dir", default="demo_out")
    p.add_argument("--runs", default="demo_out/runs")
    p.add_argument("--demo", default="demo")
    args = p.parse_args(argv)
    write_cards(args.work_dir, args.runs, args.demo)
    return 0


def write_cards(work_dir: str, runs: str, demo: str) -> None:
    """Writes the cards of the target (from `work_dir`'s runs, when its summary is there) and of
    every drafter present in both `runs` and `demo` into `demo/<name>/README.md`."""
    cards = {}
    target_summary = os.path.join(work_dir, "target_run", "summary.json")
    if os.path.isfile(target_summary):
        with open(target_summary) as fh:
            cards["target"] = target_card(json.load(fh), _distil_record(work_dir))
    for name, text in DRAFTERS.items():
        if os.path.isdir(os.path.join(runs, name)) and os.path.isdir(os.path.join(demo, name)):
            cards[name] = drafter_card(name, os.path.join(runs, name), text,
                                       os.path.join(demo, name, "calibration.json"))
    for name, text in cards.items():
        with open(os.path.join(demo, name, "README.md"), "w") as fh:
            fh.write(text)


def _distil_record(work_dir: str) -> dict | None:
    distil = None
    distil_path = os.path.join(work_dir, "mtp_run", "summary.json")
    if os.path.isfile(distil_path):
        with open(distil_path) as fh:
            distil = json.load(fh)
        with open(os.path.join(work_dir, "mtp_run", "run_config.json")) as fh:
            distil["config"] = json.load(fh)["distil_mtp"]
    return distil


if __name__ == "__main__":
    raise SystemExit(main())
