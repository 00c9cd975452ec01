"""`train.py pretrain`: data, tokenizer, joint target + MTP pretraining and the HF export of the demo.

`run_pretrain(cfg)`, outputs under `cfg.work_dir` but the exported model: `prepare_data` (corpus,
tokenizer, token streams, benchmark prompts from held-out modules, drafter prompts from training
modules); training (`demo.pretrain.Pretrainer` in `train.loop.run_loop`, resumable bit for bit);
held-out evaluation and the export (`config.json`, safetensors with the target and `mtp.*`,
tokenizer files, `generation_config.json`). Rebuilding the demo: docs/demo.md."""

from __future__ import annotations

import dataclasses
import json
import os
import time

import jax
import numpy as np

from dmtp_jax.checkpoint.hf import LoadedModel, abstract_target, save_target
from dmtp_jax.checkpoint.mtp_ckpt import abstract_mtp, mtp_tensors
from dmtp_jax.config import TargetConfig, check_config_keys
from dmtp_jax.demo import corpus
from dmtp_jax.demo.corpus import build_prompts
from dmtp_jax.demo.pretrain import PretrainStep, Pretrainer
from dmtp_jax.errors import InputError
from dmtp_jax.models.mtp import mtp_config_for
from dmtp_jax.sharding import make_mesh
from dmtp_jax.train.loop import run_loop
from dmtp_jax.train.optim import optim_config
from dmtp_jax.train.window import WindowBatches, WindowRunConfig, window_run_options


@dataclasses.dataclass
class PretrainConfig(WindowRunConfig):
    """The demo target's recipe (`configs/demo_target.py` fills it; flags override)."""
    work_dir: str = "demo_out"              # data, tokenizer, run (checkpoints, metrics)
    export_dir: str = "demo/target"         # the HF directory written at the end
    bench_prompts: str = "demo/prompts.jsonl"
    # corpus / tokenizer
    corpus_bytes: int = 4_000_000
    vocab_size: int = 4096
    num_bench_prompts: int = 12
    bench_prompt_max_chars: int = 400
    num_drafter_prompts: int = 1600
    num_calibration_prompts: int = 200      # dmtp-adaptive's threshold (training modules, another seed)
    num_mtp_prompts: int = 3000             # extra target-written text for the MTP-only phase (another seed)
    drafter_prompt_tokens: int = 96         # length of the random-window drafter prompts
    # model: "qwen3" (dense attention) or "qwen3_5" (Gated DeltaNet + gated attention, dense MLP)
    model_type: str = "qwen3"
    hidden_size: int = 256
    intermediate_size: int = 768
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    max_position_embeddings: int = 1024
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = True
    # qwen3_5 only: every `full_attention_interval`-th layer is gated attention, the rest DeltaNet
    full_attention_interval: int = 4
    partial_rotary_factor: float = 0.25
    linear_num_key_heads: int = 2
    linear_num_value_heads: int = 4
    linear_key_head_dim: int = 64
    linear_value_head_dim: int = 64
    linear_conv_kernel_dim: int = 4
    # objective and optimisation (the rest: `WindowRunConfig`'s, these defaults differ)
    mtp_lambda: float = 0.3
    mtp_stop_gradient: bool = False
    steps: int = 200
    lr: float = 3e-3
    weight_decay: float = 0.01
    compute_dtype: str = "float32"
    # run
    checkpoint_every: int = 50
    save_dtype: str = "bfloat16"
    data_only: bool = False

    @classmethod
    def from_dict(cls, d: dict) -> "PretrainConfig":
        """Rejects unknown keys."""
        check_config_keys(cls, d, "pretrain")
        return cls(**d)

    def target_hf_config(self, eos_id: int) -> dict:
        """The `config.json` dict of the target (text-only form for `qwen3_5`, one MTP layer).

        Example:
            >>> PretrainConfig(model_type="qwen3_5").target_hf_config(0)["layer_types"][:4]
            ['linear_attention', 'linear_attention', 'linear_attention', 'full_attention']
        """
        if self.model_type not in ("qwen3", "qwen3_5"):
            raise InputError(f"pretrain model_type must be 'qwen3' or 'qwen3_5', not '{self.model_type}'")
        d = {"model_type": self.model_type, "vocab_size": self.vocab_size,
             "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
             "num_hidden_layers": self.num_hidden_layers, "num_attention_heads": self.num_attention_heads,
             "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
             "max_position_embeddings": self.max_position_embeddings, "rope_theta": self.rope_theta,
             "tie_word_embeddings": self.tie_word_embeddings, "eos_token_id": eos_id, "rms_norm_eps": 1e-6}
        if self.model_type == "qwen3_5":
            every = self.full_attention_interval
            d.update(layer_types=["full_attention" if (i + 1) % every == 0 else "linear_attention"
                                  for i in range(self.num_hidden_layers)],
                     rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta,
                                      "partial_rotary_factor": self.partial_rotary_factor},
                     linear_num_key_heads=self.linear_num_key_heads,
                     linear_num_value_heads=self.linear_num_value_heads,
                     linear_key_head_dim=self.linear_key_head_dim,
                     linear_value_head_dim=self.linear_value_head_dim,
                     linear_conv_kernel_dim=self.linear_conv_kernel_dim, mtp_num_hidden_layers=1)
        return TargetConfig.from_hf_dict(d).to_hf_dict()


def _paths(cfg: PretrainConfig) -> dict:
    d = os.path.join(cfg.work_dir, "data")
    return {"data": d, "tokenizer": os.path.join(d, "tokenizer"), "train": os.path.join(d, "train_tokens.npy"),
            "val": os.path.join(d, "val_tokens.npy"), "drafter_prompts": os.path.join(d, "drafter_prompts.jsonl"),
            "calibration_prompts": os.path.join(d, "calibration_prompts.jsonl"),
            "mtp_prompts": os.path.join(d, "mtp_prompts.jsonl"),
            "manifest": os.path.join(d, "manifest.json"), "run": os.path.join(cfg.work_dir, "target_run")}


def drafter_prompts(train_files: list[str], stream: np.ndarray, tokenizer, num: int, window: int,
                    seed: int) -> list[dict]:
    """Half docstring prompts of training modules, half random code windows of `window` tokens, as
    `{"input_ids": ...}` records with no supervised token."""
    texts = build_prompts(train_files, num // 2, seed=seed, max_chars=500)
    recs = [{"text": t} for t in texts]
    rng = np.random.default_rng([seed, 1])
    for s in rng.integers(0, len(stream) - window, size=num - len(recs)):
        ids = stream[s:s + window]
        cut = np.nonzero(ids == tokenizer.eos_token_id)[0]
        ids = ids[cut[-1] + 1:] if len(cut) else ids        # never cross a file boundary
        if len(ids) >= 8:
            recs.append({"input_ids": [int(t) for t in ids]})
    return recs


def prepare_data(cfg: PretrainConfig) -> dict:
    """Builds (or reuses) the tokenizer, token streams and prompt files; returns the manifest."""
    from transformers import AutoTokenizer     # lazy: transformers imports torch (seconds)


    p = _paths(cfg)
    if os.path.isfile(p["manifest"]):
        with open(p["manifest"]) as fh:
            manifest = json.load(fh)
        write_extra_prompts(cfg, p)
        return manifest
    os.makedirs(p["data"], exist_ok=True)
    t0 = time.perf_counter()
    train_files = corpus.corpus_files(max_bytes=cfg.corpus_bytes)
    held = corpus.held_out_files()
    texts = [corpus.read_text(f) for f in train_files]
    corpus.train_tokenizer(texts, p["tokenizer"], vocab_size=cfg.vocab_size)
    tok = AutoTokenizer.from_pretrained(p["tokenizer"])
    train = corpus.encode_files(tok, texts, tok.eos_token_id)
    val = corpus.encode_files(tok, [corpus.read_text(f) for f in held], tok.eos_token_id)
    np.save(p["train"], train)
    np.save(p["val"], val)
    bench = corpus.build_prompts(held, cfg.num_bench_prompts, seed=cfg.seed, max_chars=cfg.bench_prompt_max_chars)
    corpus.write_prompt_jsonl(bench, cfg.bench_prompts)
    with open(p["drafter_prompts"], "w") as fh:
        for rec in drafter_prompts(train_files, train, tok, cfg.num_drafter_prompts, cfg.drafter_prompt_tokens,
                                   cfg.seed):
            fh.write(json.dumps(rec) + "\n")
    write_extra_prompts(cfg, p)
    manifest = {"stdlib": corpus.stdlib_root(), "train_files": len(train_files),
                "train_bytes": sum(map(len, texts)), "train_tokens": int(len(train)),
                "held_out": held, "val_tokens": int(len(val)), "bench_prompts": len(bench),
                "eos_id": int(tok.eos_token_id), "mask_id": int(tok.mask_token_id),
                "seconds": time.perf_counter() - t0}
    with open(p["manifest"], "w") as fh:
        json.dump(manifest, fh, indent=2)
    return manifest


def write_extra_prompts(cfg: PretrainConfig, paths: dict) -> None:
    """Where missing, `calibration_prompts.jsonl` and `mtp_prompts.jsonl`, drawn like the drafter
    prompts (training modules only) with other seeds."""
    from transformers import AutoTokenizer     # lazy: transformers imports torch (seconds)

    wanted = [(key, num, cfg.seed + offset) for key, num, offset in
              (("calibration_prompts", cfg.num_calibration_prompts, 1000), ("mtp_prompts", cfg.num_mtp_prompts, 2000))
              if not os.path.isfile(paths[key])]
    if not wanted:
        return
    tok = AutoTokenizer.from_pretrained(paths["tokenizer"])
    train_files = corpus.corpus_files(max_bytes=cfg.corpus_bytes)
    stream = np.load(paths["train"])
    for key, num, seed in wanted:
        with open(paths[key], "w") as fh:
            for rec in drafter_prompts(train_files, stream, tok, num, cfg.drafter_prompt_tokens, seed):
                fh.write(json.dumps(rec) + "\n")


def export_target(cfg: PretrainConfig, params, target_cfg, tokenizer_dir: str) -> str:
    """Writes the HF directory (target + `mtp.*` in `save_dtype`, tokenizer, generation config); returns
    its path."""
    mesh = make_mesh()
    tgd, _ = abstract_target(target_cfg, "float32")
    mgd, _ = abstract_mtp(target_cfg, "float32")
    target = LoadedModel(target_cfg, tgd, params["target"], mesh)
    mtp = LoadedModel(mtp_config_for(target_cfg), mgd, params["mtp"], mesh)
    out = cfg.export_dir
    os.makedirs(out, exist_ok=True)
    save_target(target, out, dtype=cfg.save_dtype, extra_tensors=mtp_tensors(mtp, dtype=cfg.save_dtype),
                copy_files_from=tokenizer_dir)
    with open(os.path.join(out, "generation_config.json"), "w") as fh:
        json.dump({"eos_token_id": target_cfg.eos_token_ids[0], "pad_token_id": target_cfg.eos_token_ids[0],
                   "do_sample": False}, fh, indent=2)
    return out


def run_pretrain(cfg: PretrainConfig) -> dict:
    """Data, training (resumable), evaluation and export: the summary (also
    `<work_dir>/target_run/summary.json`). A run stopped by SIGTERM / SIGINT returns the loop's
    summary with a checkpoint written, without evaluating or exporting."""

    p = _paths(cfg)
    manifest = prepare_data(cfg)
    if cfg.data_only:
        return {"data": manifest}
    target_cfg = TargetConfig.from_hf_dict(cfg.target_hf_config(manifest["eos_id"]))
    ocfg = optim_config(cfg)
    pt = Pretrainer(target_cfg, PretrainStep(cfg.mtp_lambda, cfg.mtp_stop_gradient, cfg.compute_dtype), ocfg)
    length = cfg.seq_len + 1
    state, run = run_loop(
        window_run_options(cfg, p["run"]),
        pt, cfg.seed, WindowBatches(np.load(p["train"]), cfg.batch_size, length, cfg.seed),
        {"pretrain": dataclasses.asdict(cfg), "target": cfg.target_hf_config(manifest["eos_id"])})
    if run["stopped_by"]:
        return {k: v for k, v in run.items() if k not in ("records", "losses")}
    val = WindowBatches(np.load(p["val"]), cfg.batch_size, length, cfg.seed + 1)
    evaluation = pt.evaluate(state.params, [val.batch(i) for i in range(cfg.eval_batches)])
    out = export_target(cfg, state.params, target_cfg, p["tokenizer"])
    summary = {"steps": run["step"], "start_step": run["start_step"], "train_seconds": run["train_seconds"],
               "last": run["last"], "held_out_eval": evaluation,
               "export_dir": out, "compile_count": pt.compile_count(),
               "params": int(sum(x.size for x in jax.tree.leaves(state.params["target"]))),
               "mtp_params": int(sum(x.size for x in jax.tree.leaves(state.params["mtp"]))), "data": manifest}
    with open(os.path.join(p["run"], "summary.json"), "w") as fh:
        json.dump(summary, fh, indent=2)
    return summary
