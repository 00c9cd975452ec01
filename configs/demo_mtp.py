"""The demo target's MTP-only phase: the target frozen, its MTP head distilled toward the target's own
next-token distributions on text the target wrote: the drafters' data (`demo/regen.jsonl`) plus the
target's answers to 3000 more training-module prompts (`demo_out/mtp_regen.jsonl`). A native MTP
head is trained on far more data than any drafter (the paper's premise); this is the demo's share.

    python train.py regen --target demo/target --data demo_out/data/mtp_prompts.jsonl \
        --out demo_out/mtp_regen.jsonl --max-new-tokens 64 --batch-size 64
    python train.py distil-mtp --config configs/demo_mtp.py            # ~12 min on 2 CPU cores
    python train.py distil-mtp --config configs/demo_mtp.py --resume   # after an interruption

Keeps the pretrained (corpus-only) head in `demo/mtp_corpus` on the first run and always starts
from it; writes the distilled head into `demo/target` (`mtp.*`, bf16). Run it after
`train.py regen` (see `configs/demo_dflash.py`) and before training the DMTP drafters.
"""

COMMAND = "distil-mtp"


def get_config() -> dict:
    return dict(
        target="demo/target", data=("demo/regen.jsonl", "demo_out/mtp_regen.jsonl"),
        corpus_head_dir="demo/mtp_corpus",
        val_tokens="demo_out/data/val_tokens.npy", run_dir="demo_out/mtp_run",
        # soft cross-entropy to softmax(target logits) of the token the head predicts, every row
        seq_len=256, batch_size=16, steps=600, lr=2e-3, warmup_steps=20, min_lr_ratio=0.1,
        weight_decay=0.0, max_grad_norm=1.0, compute_dtype="float32", seed=0, eval_batches=8,
        checkpoint_every=100, keep_checkpoints=2, save_dtype="bfloat16", mtp_lambda=0.3,
    )
