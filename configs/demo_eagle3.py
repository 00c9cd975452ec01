"""The demo's EAGLE-3 drafter: one Llama-style layer over the target's layer 0 / 1 / 2 outputs, a chain
of 7 drafts (block 8), trained with training-time test (7 unrolled passes, weights 0.8^k) on the same
data, steps and hyper-parameters as the demo's DFlash drafter (`configs/demo_dflash.py` `SHARED`).

    python train.py --config configs/demo_eagle3.py                          # = train --config ...
    python train.py export --run demo_out/runs/eagle3 --out demo/eagle3 --dtype bfloat16
"""

import os

from dmtp_jax.cli import load_config_file

COMMAND = "train"


def get_config() -> dict:
    shared = load_config_file(os.path.join(os.path.dirname(os.path.abspath(__file__)), "demo_dflash.py"))
    return dict(shared, method="eagle3", out="demo_out/runs/eagle3", target_layer_ids=(0, 1, 2))


# Shipped run: 200 steps in two parts (SIGTERM after step 126, then `--resume`): 59.2 min on 2 cores shared
# with a test suite (load 4-11), then 22.9 min nearly alone (about 9-10 s/step against dflash's 1.8).
# acc_0 / acc_6: top-1 agreement of pass 0 / pass 6 (the 1st / 7th chained draft), mean of the last 20 steps.
RESULTS = dict(train_minutes=82.1, steps=200, first_loss=32.93, last_loss=3.719, mean_loss_last20=2.652,
               acc_0_last20=0.837, acc_6_last20=0.815)
