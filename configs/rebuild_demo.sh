#!/usr/bin/env bash
# Re-creates every shipped demo model from scratch on 2 CPU cores (about 2 hours). Each step is
# resumable: re-run the script after an interruption (finished steps are skipped, `--resume`
# continues a cut training run). Held-out modules (demo/prompts.jsonl) are used by no step.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
done_() { [ -e "$1" ]; }

# 1. corpus, tokenizer, prompts; the Qwen3.5-format hybrid target pretrained jointly with its MTP head
done_ demo_out/target_run/summary.json || $PY train.py pretrain --config configs/demo_target.py --resume
$PY train.py pretrain --config configs/demo_target.py --data-only >/dev/null    # the prompt files, if missing
# 2. the target's greedy answers to training-module prompts: the drafters' data, and the calibration text
done_ demo_out/regen.done || { rm -f demo/regen.jsonl
  $PY train.py regen --target demo/target --data demo_out/data/drafter_prompts.jsonl --out demo/regen.jsonl \
      --max-new-tokens 64 --batch-size 64 && touch demo_out/regen.done; }
done_ demo_out/calibration.done || { rm -f demo_out/calibration.jsonl
  $PY train.py regen --target demo/target --data demo_out/data/calibration_prompts.jsonl \
      --out demo_out/calibration.jsonl --max-new-tokens 64 --batch-size 64 && touch demo_out/calibration.done; }
done_ demo_out/mtp_regen.done || { rm -f demo_out/mtp_regen.jsonl
  $PY train.py regen --target demo/target --data demo_out/data/mtp_prompts.jsonl \
      --out demo_out/mtp_regen.jsonl --max-new-tokens 64 --batch-size 64 && touch demo_out/mtp_regen.done; }
# 3. the MTP-only phase (keeps the corpus-only head in demo/mtp_corpus) || the DFlash drafter
train() {  # run-name, config, extra flags...: train (resumable) and export to demo/<run-name>
  local name=$1 config=$2; shift 2
  done_ "demo_out/runs/$name/exported" && return 0
  $PY train.py --config "$config" --out "demo_out/runs/$name" --resume "$@"
  rm -rf "demo/$name"
  $PY train.py export --run "demo_out/runs/$name" --out "demo/$name" --dtype bfloat16
  # the supervised tokens' counts: --draft-head efficient --draft-head-vocab N's frequency subset
  $PY train.py token-counts --target demo/target --data demo/regen.jsonl --out "demo/$name" --seq-len 256 \
      --no-progress && touch "demo_out/runs/$name/exported"
}
{ done_ demo_out/mtp_run/summary.json || $PY train.py distil-mtp --config configs/demo_mtp.py --resume; } &
train dflash configs/demo_dflash.py &
wait
# 4. the DMTP drafters: with the target's (distilled) head and with the corpus-only head, same data and steps;
#    then the dmtp-adaptive drafters, each starting from its head's trained dmtp drafter
train dmtp configs/demo_dmtp.py &
train dmtp_corpus configs/demo_dmtp.py --mtp demo/mtp_corpus &
wait
train dmtp_adaptive configs/demo_dmtp_adaptive.py &
train dmtp_adaptive_corpus configs/demo_dmtp_adaptive.py --mtp demo/mtp_corpus --init-from demo/dmtp_corpus &
wait
# 4b. the EAGLE-3 drafter (the baseline without native MTP): same data, steps and hyper-parameters as dflash
train eagle3 configs/demo_eagle3.py
# 5. dmtp-adaptive's thresholds, on the calibration text (training modules)
$PY train.py calibrate --target demo/target --draft demo/dmtp_adaptive --data demo_out/calibration.jsonl
$PY train.py calibrate --target demo/target --draft demo/dmtp_adaptive_corpus --mtp demo/mtp_corpus \
    --data demo_out/calibration.jsonl
$PY -m dmtp_jax.demo.cards          # the model cards, from the runs' own records
echo "rebuilt: demo/target demo/mtp_corpus demo/dflash demo/dmtp demo/dmtp_adaptive demo/dmtp_corpus demo/dmtp_adaptive_corpus demo/eagle3"
