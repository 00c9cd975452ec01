"""Cache memory per row for the paper's targets (Qwen3.6-27B, Qwen3.6-35B-A3B) in our design.

Configs are the released text configs' sizes (hidden, layer pattern, heads); nothing is downloaded.
Run: `python benchmarks/state_memory.py [--max-len 32768]`.
"""

from __future__ import annotations

import argparse

from dmtp_jax.config import TargetConfig
from dmtp_jax.decode.caches import state_bytes_per_row

COMMON = dict(vocab_size=248320, head_dim=256, linear_key_head_dim=128, linear_value_head_dim=128,
              linear_conv_kernel_dim=4, linear_num_key_heads=16, rms_norm_eps=1e-6,
              max_position_embeddings=262144,
              rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25})
PAPER_TARGETS = {
    "Qwen3.6-27B": dict(COMMON, model_type="qwen3_5_text", hidden_size=5120, num_hidden_layers=64,
                        intermediate_size=17408, num_attention_heads=24, num_key_value_heads=4,
                        linear_num_value_heads=48),
    "Qwen3.6-35B-A3B": dict(COMMON, model_type="qwen3_5_moe_text", hidden_size=2048, num_hidden_layers=40,
                            num_attention_heads=16, num_key_value_heads=2, linear_num_value_heads=32,
                            num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
                            shared_expert_intermediate_size=512),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-len", type=int, default=32768, help="cache slots per row")
    args = parser.parse_args()
    mib = 1 << 20
    print(f"bf16 K/V and conv windows, fp32 DeltaNet states; {args.max_len} cache slots per row")
    print(f"{'target':<18}{'K/V MiB':>10}{'K/V KiB/token':>15}{'conv MiB':>10}{'ssm MiB':>10}"
          f"{'verify MiB':>12}{'x8 snapshots MiB':>18}")
    for name, d in PAPER_TARGETS.items():
        b = state_bytes_per_row(TargetConfig.from_hf_dict(d), args.max_len)
        print(f"{name:<18}{b['kv'] / mib:>10.0f}{b['kv'] / args.max_len / 1024:>15.1f}{b['conv'] / mib:>10.2f}"
              f"{b['ssm'] / mib:>10.0f}{b['verify_transient'] / mib:>12.1f}{8 * b['ssm'] / mib:>18.0f}")
    print("verify: per-token DeltaNet inputs a round keeps for its commit (replay); "
          "x8 snapshots: what per-slot state snapshots would add instead.")


if __name__ == "__main__":
    main()
