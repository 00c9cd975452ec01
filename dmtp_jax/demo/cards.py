"""Model cards (`README.md`) of the shipped demo directories, written from the runs' own records.

    python -m dmtp_jax.demo.cards --work-dir demo_out --runs demo_out/runs --demo demo

Example:
    >>> print(target_card(json.load(open("demo_out/target_run/summary.json"))))  # doctest: +SKIP
"""

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


def target_card(summary: dict) -> str:
    """The target's card from `target_run/summary.json`.

    Example:
        >>> target_card({"steps": 1, "train_seconds": 2.0, "last": {}, "held_out_eval": {}, "params": 3,
        ...              "mtp_params": 1, "data": {}}).splitlines()[0]
        '# demo/target: a tiny Qwen3 pretrained on the Python stdlib, with a native MTP head'
    """
    d, last, ev = summary.get("data", {}), summary.get("last") or {}, summary.get("held_out_eval", {})
    return "\n".join([
        "# demo/target: a tiny Qwen3 pretrained on the Python stdlib, with a native MTP head",
        "",
        f"Qwen3 (dense, tied embeddings), {summary['params'] / 1e6:.2f} M parameters, plus a Qwen3.5-format "
        f"MTP head (`mtp.*`, {summary['mtp_params'] / 1e6:.2f} M) trained jointly from scratch: loss = "
        "main CE + 0.3 x MTP CE, MTP gradients flowing into the trunk (DeepSeek-V3 style). Weights bf16.",
        "",
        f"Data: {d.get('train_files', '?')} stdlib modules of CPython ({d.get('train_bytes', 0) / 1e6:.1f} MB, "
        f"{d.get('train_tokens', 0) / 1e6:.2f} M tokens, byte-level BPE of 4096 tokens trained on the same "
        "text); test directories and 30 held-out modules excluded (`dmtp_jax/demo/corpus.py`).",
        "",
        f"Training: {summary['steps']} steps x 16 windows x 256 tokens, AdamW, "
        f"{summary['train_seconds'] / 60:.1f} min on 2 CPU cores (`configs/demo_target.py`).",
        f"Last step: main CE {_fmt(last.get('main_ce'))}, MTP CE {_fmt(last.get('mtp_ce'))}. Held-out modules: "
        f"main CE {_fmt(ev.get('main_ce'))} (top-1 {_fmt(ev.get('main_acc'))}), MTP CE {_fmt(ev.get('mtp_ce'))} "
        f"(top-1 {_fmt(ev.get('mtp_acc'))}).",
        "",
        "It writes Python-flavoured text (keywords, indentation, `self.` chains, docstring-like comments), "
        "often repetitive under greedy decoding, never correct programs: a model for demonstrating the "
        "decoding methods on a CPU, not a code model.",
        "",
        LICENCE, ""])


def drafter_card(name: str, run_dir: str, method_text: str) -> str:
    """A drafter's card from its run directory (`run_config.json`, `metrics.jsonl`).

    Example:
        >>> drafter_card("dflash", "demo_out/runs/dflash", "DFlash")  # doctest: +SKIP
    """
    with open(os.path.join(run_dir, "run_config.json")) as fh:
        cfg = json.load(fh)["train"]
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        recs = [json.loads(line) for line in fh if line.strip()]
    last = recs[-1] if recs else {}
    tail = recs[-20:]
    mean = (lambda k: sum(r[k] for r in tail) / len(tail)) if tail else (lambda k: None)
    seconds = sum(r.get("step_s", 0.0) for r in recs)
    return "\n".join([
        f"# demo/{name}: {method_text}",
        "",
        f"Drafter for `demo/target`: {cfg['draft_layers']} layers, block {cfg['block_size']} "
        f"({cfg['block_size'] - 1} candidates), context from target layers {cfg['target_layer_ids']}. "
        "Weights bf16; embedding and LM head are the target's.",
        "",
        "Data: the target's greedy continuations (64 new tokens) of 1595 prompts from the training modules "
        "(`train.py regen`); the held-out modules are never seen.",
        "",
        f"Training: {last.get('step', '?')} steps x {cfg['batch_size']} sequences x {cfg['seq_len']} tokens, "
        f"{cfg['num_anchors']} anchors, lr {cfg['lr']}, {seconds / 60:.1f} min on 2 CPU cores "
        f"(`configs/demo_{name}.py`). Final loss {_fmt(last.get('loss'))} (mean of the last 20 steps "
        f"{_fmt(mean('loss'))}), top-1 accuracy on the predicted slots {_fmt(mean('acc'))} (last 20 steps).",
        "",
        LICENCE, ""])


def main(argv=None) -> int:
    """Writes the three cards."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--work-dir", default="demo_out")
    p.add_argument("--runs", default="demo_out/runs")
    p.add_argument("--demo", default="demo")
    args = p.parse_args(argv)
    with open(os.path.join(args.work_dir, "target_run", "summary.json")) as fh:
        summary = json.load(fh)
    cards = {"target": target_card(summary),
             "dflash": drafter_card("dflash", os.path.join(args.runs, "dflash"),
                                    "a DFlash block-diffusion drafter"),
             "dmtp": drafter_card("dmtp", os.path.join(args.runs, "dmtp"),
                                  "a DMTP drafter (DFlash + T1 fusion, main variant `dmtp`)")}
    for name, text in cards.items():
        with open(os.path.join(args.demo, name, "README.md"), "w") as fh:
            fh.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
