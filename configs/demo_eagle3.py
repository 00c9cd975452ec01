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


# Shipped run: stopped by SIGTERM after step 126 of 200 (the machine's 2 cores were shared with a test suite
# and other runs, load 4-11; about 20-50 s/step against dflash's 1.8); `--resume` continues it to 200.
# acc_0 / acc_6: top-1 agreement of pass 0 / pass 6 (the 1st / 7th chained draft), mean of the last 20 steps.
RESULTS = dict(train_minutes=59.2, steps=126, first_loss=32.93, last_loss=3.442, mean_loss_last20=3.903,
               acc_0_last20=0.795, acc_6_last20=0.724)
