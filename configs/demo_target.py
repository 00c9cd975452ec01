"""The demo target: a miniature Qwen3.6 (Qwen3.5-format hybrid: three Gated DeltaNet layers and one
gated-attention layer, dense MLP) pretrained from scratch on the Python stdlib jointly with its native
MTP head (`mtp.*`).

    python train.py pretrain --config configs/demo_target.py          # ~20 min on 2 CPU cores
    python train.py pretrain --config configs/demo_target.py --resume  # after an interruption

Writes the tokenizer, token streams and prompt files under `demo_out/data`, the run (orbax
checkpoints, metrics.jsonl, summary.json) under `demo_out/target_run`, and the HF directory
`demo/target` (bf16). Held-out modules, corpus rules: `dmtp_jax/demo/corpus.py` (`HELD_OUT`).
`RESULTS` records what the shipped run measured.
"""

COMMAND = "pretrain"


def get_config() -> dict:
    return dict(
        work_dir="demo_out", export_dir="demo/target", bench_prompts="demo/prompts.jsonl",
        # corpus: stdlib *.py of the running interpreter (3.11.7 for the shipped run), minus tests,
        # pydoc_data, encodings, files > 150 kB and the 30 held-out modules; hash order, <= 4 MB
        corpus_bytes=4_000_000, vocab_size=4096, num_bench_prompts=12, bench_prompt_max_chars=400,
        num_drafter_prompts=1600, drafter_prompt_tokens=96,
        # model: Qwen3.5 hybrid (layers 0-2 Gated DeltaNet, layer 3 gated attention with partial
        # RoPE 0.25), dense MLP, tied embeddings; the MTP head is one gated-attention layer + fc + 3 norms
        model_type="qwen3_5", full_attention_interval=4, partial_rotary_factor=0.25,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64,
        linear_conv_kernel_dim=4, hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, max_position_embeddings=1024, rope_theta=10000.0,
        tie_word_embeddings=True,
        # objective: main CE + 0.3 * MTP CE, MTP gradients flow into the trunk (DeepSeek-V3)
        mtp_lambda=0.3, mtp_stop_gradient=False,
        # optimisation: AdamW (b1 0.9, b2 0.95), warmup + cosine to 0.1 * lr, clip 1.0, fp32
        seq_len=256, batch_size=16, steps=400, lr=3e-3, warmup_steps=20, min_lr_ratio=0.1,
        weight_decay=0.01, max_grad_norm=1.0, compute_dtype="float32", seed=0, eval_batches=8,
        checkpoint_every=100, keep_checkpoints=2, save_dtype="bfloat16",
    )


# What the shipped run measured (CPython 3.11.7 stdlib, 2 shared CPU cores, jax 0.10.2 CPU).
RESULTS = dict(
    corpus=dict(train_files=286, train_bytes=3_999_960, train_tokens=1_097_462, held_out_modules=30,
                held_out_tokens=173_408, tokenizer_vocab=4096, eos_id=0, mask_id=1),
    params=dict(target=4_471_384, mtp=984_448),
    train_minutes=26.4, tokens_per_s=1400,     # shared the 2 cores with other work for part of the run
    last_step=dict(loss=5.073, main_ce=3.929, mtp_ce=3.815, main_acc=0.293, mtp_acc=0.319),
    held_out=dict(main_ce=4.476, main_acc=0.227, mtp_ce=4.269, mtp_acc=0.251),
    # MTP top-1 agreement with the target's own argmax (teacher-forced, held-out windows): 0.524
    # for this corpus-only head; the MTP-only phase (configs/demo_mtp.py) takes it further.
)
