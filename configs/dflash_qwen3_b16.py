"""DFlash drafter for a Qwen3 target, SpecForge's recipe (block 16, gamma 7, 512 anchors,
5 drafter layers, bf16 compute, warmup + cosine). Give --target, --data (target-regenerated
conversations) and --out on the command line."""


def get_config() -> dict:
    return dict(method="dflash", steps=20000, batch_size=64, seq_len=3072, draft_layers=5,
                block_size=16, gamma=7.0, num_anchors=512, lr=6e-4, warmup_steps=400,
                min_lr_ratio=0.1, weight_decay=0.0, max_grad_norm=1.0, grad_accum=1,
                compute_dtype="bfloat16", checkpoint_every=500, keep_checkpoints=3)
