"""A tiny DFlash run for smoke tests on CPU: `python train.py train --config configs/dflash_tiny.py
--target DIR --data FILE --out RUN` (any flag overrides these values)."""


def get_config() -> dict:
    return dict(method="dflash", steps=60, batch_size=8, seq_len=64, draft_layers=1, block_size=8,
                num_anchors=8, lr=3e-3, warmup_steps=5, compute_dtype="float32",
                checkpoint_every=20, keep_checkpoints=2)
