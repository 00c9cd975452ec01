"""`train.py distil-mtp`: the MTP-only phase of the demo target (`demo.pretrain.MtpDistiller`).

The target is frozen; its MTP head as pretraining left it (the corpus head, kept once in
`cfg.corpus_head_dir`, so every run starts from it) learns the target's own next-token
distribution on regen text (`train.window.WindowBatches` over one EOS-joined stream) in
`train.loop.run_loop`. Both heads are evaluated on held-out windows; the distilled head then
replaces the target directory's `mtp.*` tensors (the target's own tensors copied byte for byte)."""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import numpy as np

from dmtp_jax.checkpoint.hf import load_target
from dmtp_jax.checkpoint.mtp_ckpt import MTP_PREFIX, has_mtp, load_mtp, mtp_tensors
from dmtp_jax.checkpoint.safetensors_io import CheckpointReader, SafetensorsFile, write_safetensors
from dmtp_jax.config import check_config_keys
from dmtp_jax.demo.pretrain import MtpDistiller
from dmtp_jax.errors import InputError
from dmtp_jax.train.data import read_records, token_stream
from dmtp_jax.train.loop import run_loop
from dmtp_jax.train.optim import optim_config
from dmtp_jax.train.window import WindowBatches, WindowRunConfig, window_run_options

CORPUS_HEAD_CARD = """# {name}: the demo target's corpus-only MTP head

The `mtp.*` tensors of `demo/target` as joint pretraining left them (main CE + {mtp_lambda} x MTP CE on
the stdlib corpus), before the MTP-only distillation phase (`configs/demo_mtp.py`) made the shipped
head a predictor of its own target. Kept to show the paper's stated limitation -- a weak MTP head --
and to train the drafters that run with it:

    python infer.py bench --mtp {name} ...      # dmtp with this head instead of the target's

Same format as the target's `mtp.*` tensors (bf16); loads with `--mtp {name}`.
"""


@dataclasses.dataclass
class DistilConfig(WindowRunConfig):
    """The MTP-only phase (`configs/demo_mtp.py` fills it; flags override); optimisation and run fields
    are `WindowRunConfig`'s."""
    target: str = "demo/target"                 # frozen target; its mtp.* tensors are replaced
    data: str | tuple[str, ...] = "demo/regen.jsonl"    # text the target wrote (one file or several)
    corpus_head_dir: str = "demo/mtp_corpus"    # the pretrained (corpus-only) head, kept
    val_tokens: str = "demo_out/data/val_tokens.npy"
    run_dir: str = "demo_out/mtp_run"
    compute_dtype: str = "float32"
    save_dtype: str = "bfloat16"
    mtp_lambda: float = 0.3                     # for the corpus head's card only

    @classmethod
    def from_dict(cls, d: dict) -> "DistilConfig":
        """Rejects unknown keys.

        Example:
            >>> DistilConfig.from_dict({"steps": 3}).steps
            3
        """
        check_config_keys(cls, d, "distil-mtp")
        return cls(**d)


def regen_stream(paths: str | tuple[str, ...], eos_id: int) -> np.ndarray:
    """The tokens of every regen record of `paths` (one file or several), each followed by `eos_id`, as
    one int32 stream."""
    paths = (paths,) if isinstance(paths, str) else tuple(paths)
    ids = np.concatenate([token_stream(read_records(path), eos_id) for path in paths])
    if not len(ids):
        raise InputError(f"{', '.join(paths)}: no records with 'input_ids' (run `train.py regen` first)")
    return ids


def keep_corpus_head(target_dir: str, out_dir: str, card: str) -> None:
    """Copies the target's `mtp.*` tensors to `out_dir` unless it already holds a head."""
    if os.path.isdir(out_dir) and has_mtp(out_dir):
        return
    reader = CheckpointReader(target_dir)
    tensors = {k: np.array(reader.array(k)) for k in reader.keys() if k.startswith(MTP_PREFIX)}
    if not tensors:
        raise InputError(f"{target_dir} has no 'mtp.*' tensors to distil")
    os.makedirs(out_dir, exist_ok=True)
    write_safetensors(os.path.join(out_dir, "model.safetensors"), tensors)
    with open(os.path.join(out_dir, "README.md"), "w") as fh:
        fh.write(card)


def replace_mtp_tensors(target_dir: str, mtp_tensors: dict[str, np.ndarray]) -> None:
    """Rewrites the target's single `model.safetensors` with `mtp.*` replaced (atomic)."""
    path = os.path.join(target_dir, "model.safetensors")
    if not os.path.isfile(path):
        raise InputError(f"{target_dir}: distil-mtp writes single-file targets (model.safetensors)")
    f = SafetensorsFile(path)
    tensors = {k: np.array(f.array(k)) for k in f.keys() if not k.startswith(MTP_PREFIX)}
    tensors.update(mtp_tensors)
    write_safetensors(path, tensors, f.metadata)


def run_distil(cfg: DistilConfig) -> dict:
    """Keeps the corpus head, distils, evaluates both heads and writes the distilled head into the
    target: the summary (also `<run_dir>/summary.json`). A stopped run leaves the target untouched."""

    name = os.path.basename(os.path.normpath(cfg.corpus_head_dir))
    keep_corpus_head(cfg.target, cfg.corpus_head_dir, CORPUS_HEAD_CARD.format(name=name, mtp_lambda=cfg.mtp_lambda))
    target = load_target(cfg.target, "float32")
    corpus_head = load_mtp(cfg.corpus_head_dir, target.cfg, "float32", target.mesh)
    stream = regen_stream(cfg.data, target.cfg.eos_token_ids[0])
    ocfg = optim_config(cfg)
    distiller = MtpDistiller(target.cfg, target.state, corpus_head.state, ocfg, cfg.compute_dtype)
    length = cfg.seq_len + 1
    state, run = run_loop(
        window_run_options(cfg, cfg.run_dir),
        distiller, cfg.seed, WindowBatches(stream, cfg.batch_size, length, cfg.seed),
        {"distil_mtp": dataclasses.asdict(cfg)})
    if run["stopped_by"]:
        return {k: v for k, v in run.items() if k not in ("records", "losses")}
    evaluation = {}
    if os.path.isfile(cfg.val_tokens):
        val = WindowBatches(np.load(cfg.val_tokens), cfg.batch_size, length, cfg.seed + 1)
        batches = [val.batch(i) for i in range(cfg.eval_batches)]
        evaluation = {"corpus_head": distiller.evaluate({"mtp": corpus_head.state}, batches),
                      "distilled_head": distiller.evaluate(state.params, batches)}
    head = dataclasses.replace(corpus_head, state=state.params["mtp"])
    replace_mtp_tensors(cfg.target, mtp_tensors(head, dtype=cfg.save_dtype))
    summary = {"steps": run["step"], "start_step": run["start_step"], "train_seconds": run["train_seconds"],
               "last": run["last"], "held_out_eval": evaluation, "stream_tokens": int(len(stream)),
               "compile_count": distiller.compile_count(),
               "mtp_params": int(sum(x.size for x in jax.tree.leaves(state.params["mtp"])))}
    with open(os.path.join(cfg.run_dir, "summary.json"), "w") as fh:
        json.dump(summary, fh, indent=2)
    return summary
