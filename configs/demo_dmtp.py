"""The demo's DMTP drafter (main variant `dmtp`: the target's MTP head proposes T1, the DFlash
drafter with a T1 fusion proposes T2..T7), with exactly the DFlash drafter's data, steps and
hyper-parameters (`configs/demo_dflash.py` `SHARED`), trained from scratch.

    python train.py --config configs/demo_dmtp.py                            # = train --config ...
    python train.py export --run demo_out/runs/dmtp --out demo/dmtp --dtype bfloat16

The data file is built as in `configs/demo_dflash.py` (regen of the demo target).
"""

import os

from dmtp_jax.cli import load_config_file

COMMAND = "train"


def get_config() -> dict:
    shared = load_config_file(os.path.join(os.path.dirname(os.path.abspath(__file__)), "demo_dflash.py"))
    return dict(shared, method="dmtp", out="demo_out/runs/dmtp")


# Shipped runs (two at a time on 2 cores): with the target's distilled head, and with
# `--mtp demo/mtp_corpus --out demo_out/runs/dmtp_corpus` (exported to demo/dmtp_corpus).
RESULTS = dict(train_minutes=5.9, first_loss=38.93, last_loss=1.667, mean_loss_last20=1.221,
               slot_acc_last20=0.695)
RESULTS_CORPUS_HEAD = dict(train_minutes=5.7, first_loss=38.93, last_loss=1.700, mean_loss_last20=1.245,
                           slot_acc_last20=0.693)
