"""The demo's dmtp-adaptive drafter (one drafter, two first-candidate modes): `dmtp`'s fusion and
block, trained on both blocks at every anchor -- DMTP mode (MTP's T1 fused, T2..T7 supervised) and
DFlash mode (T1 slot MASK, T1..T7 supervised) -- with exactly the DFlash drafter's data, steps,
anchors and hyper-parameters (`configs/demo_dflash.py` `SHARED`), from scratch; each step runs the
drafter over twice the blocks of the other drafters. Then its threshold is
calibrated on target-written training text (never on the held-out prompts):

    python train.py --config configs/demo_dmtp_adaptive.py
    python train.py export --run demo_out/runs/dmtp_adaptive --out demo/dmtp_adaptive --dtype bfloat16
    python train.py calibrate --target demo/target --draft demo/dmtp_adaptive --data demo_out/calibration.jsonl

With the corpus-only MTP head (the weak-head table): add `--mtp demo/mtp_corpus --out
demo_out/runs/dmtp_adaptive_corpus`, export to `demo/dmtp_adaptive_corpus`, calibrate with
`--mtp demo/mtp_corpus`.
"""

import os

from dmtp_jax.cli import load_config_file

COMMAND = "train"


def get_config() -> dict:
    shared = load_config_file(os.path.join(os.path.dirname(os.path.abspath(__file__)), "demo_dflash.py"))
    return dict(shared, method="dmtp-adaptive", out="demo_out/runs/dmtp_adaptive")


# Shipped runs (both heads concurrently on 2 cores); calibrated thresholds: 0.0 (distilled head: every
# round takes MTP's T1), 0.2 (corpus-only head: 62 % of calibration anchors).
RESULTS = dict(train_minutes=9.1, first_loss=38.88, last_loss=1.956, mean_loss_last20=1.426,
               slot_acc_last20=0.665, threshold=0.0)
RESULTS_CORPUS_HEAD = dict(train_minutes=9.1, first_loss=38.88, last_loss=1.929, mean_loss_last20=1.408,
                           slot_acc_last20=0.670, threshold=0.2)
