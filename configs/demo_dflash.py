"""The demo's DFlash drafter: 2 layers, block 8 (7 candidates), trained on the demo target's own
greedy continuations of training-module prompts.

    # every step of the demo, in order and resumable: bash configs/rebuild_demo.sh
    # the shipped demo/regen.jsonl was made by (rebuild it after re-training the target):
    python train.py pretrain --config configs/demo_target.py --data-only     # prompts (if missing)
    python train.py regen --target demo/target --data demo_out/data/drafter_prompts.jsonl \\
        --out demo/regen.jsonl --max-new-tokens 64 --batch-size 64
    python train.py --config configs/demo_dflash.py                          # = train --config ...
    python train.py export --run demo_out/runs/dflash --out demo/dflash --dtype bfloat16

`configs/demo_dmtp.py` and `configs/demo_dmtp_adaptive.py` use the same data, steps and
hyper-parameters (`SHARED`), with either MTP head.
"""

COMMAND = "train"

# Everything but the method is shared with the DMTP drafters (the paper's protocol).
SHARED = dict(
    target="demo/target", data="demo/regen.jsonl",
    steps=200, batch_size=16, seq_len=256, draft_layers=2, block_size=8,
    target_layer_ids=(0, 1, 2, 3), num_anchors=16, gamma=None,   # gamma None: 4.0 for block 8
    lr=2e-3, warmup_steps=20, min_lr_ratio=0.1, weight_decay=0.0, max_grad_norm=1.0,
    grad_accum=1, compute_dtype="float32", target_dtype="float32", seed=0,
    checkpoint_every=100, keep_checkpoints=2,
)


def get_config() -> dict:
    return dict(SHARED, method="dflash", out="demo_out/runs/dflash")


# Shipped run: data = `train.py regen` (greedy, 64 new tokens, batch 64) of the 1595 prompts in
# demo_out/data/drafter_prompts.jsonl: about 1 min. Trained concurrently with the MTP-only phase on 2 cores.
RESULTS = dict(train_minutes=6.1, first_loss=38.83, last_loss=2.128, mean_loss_last20=1.594,
               slot_acc_last20=0.614)
