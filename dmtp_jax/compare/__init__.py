"""Numerics of our JAX target against transformers on the same checkpoint directory.

`compare_target` loads the checkpoint in transformers (fp32 torch: the reference) and in JAX at the
requested dtype, runs a few random prompts (one of ~300 tokens) through both and returns one check
`{"name", "max_abs_diff", "tolerance", "ok"}` per comparison: logits, argmax agreement, each layer's
hidden state, cached decode, DeltaNet state, greedy continuation, MTP head (or Gemma 4 assistant) and
drafter. The checks and their tolerances (`TOLERANCES`) are listed in docs/numerics.md. Needs torch
(the `test` extra).

Example:
    >>> report = compare_target("/path/to/Qwen3-0.6B", dtype="float32")  # needs a checkpoint dir and torch  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib

import jax.numpy as jnp
import numpy as np

from dmtp_jax.checkpoint.hf import load_target
from dmtp_jax.checkpoint.assistant_ckpt import is_assistant_dir
from dmtp_jax.checkpoint.mtp_ckpt import has_mtp
from dmtp_jax.compare.checks import (TOLERANCES, check, make_prompts, max_abs_diff, right_pad,
                                     scaled_tolerance)
from dmtp_jax.compare.forward import jax_cached_logits, jax_forward, prefill_logits
from dmtp_jax.compare.heads import assistant_check, drafter_checks, mtp_check
from dmtp_jax.decode.ar import ARDecoder
from dmtp_jax.decode.caches import TargetCaches
from dmtp_jax.sharding import make_mesh

# ---------------------------------------------------------------- transformers (the reference)
def hf_reference(model, prompts, num_new_tokens: int) -> list[dict]:
    """Per prompt: fp32 `logits [T, V]`, `hidden` (HF hidden_states[1:], each `[T, H]`), greedy `generated`."""
    import torch     # optional: the `test` extra

    # generate() merges a per-call eos_token_id=None with the model's default: clear it at the source.
    model.generation_config.eos_token_id = None
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p], dtype=torch.long)
            res = model(ids, output_hidden_states=True)
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=num_new_tokens, pad_token_id=0)
            out.append({"logits": res.logits[0].float().numpy(),
                        "hidden": [h[0].float().numpy() for h in res.hidden_states[1:]],
                        "generated": gen[0, len(p):].tolist()})
    return out


def deltanet_state_check(target, hf_model, prompt: list[int], rtol: float, q: float) -> dict:
    """`deltanet_state`: our conv windows and recurrent states after a prefill of `prompt` vs the
    transformers cache (whose conv state keeps K columns; ours the last K-1 inputs), max over layers,
    scaled by the largest reference state entry."""
    import torch     # optional: the `test` extra
    from transformers import DynamicCache     # needs torch (the `test` extra)

    ids = torch.tensor([prompt])
    with torch.no_grad():
        hf_cache = DynamicCache(config=hf_model.config)
        hf_model(ids, cache=hf_cache, use_cache=True)
    cache = TargetCaches(target).new(1, -(-(len(prompt) + 1) // 128) * 128)
    _, cache = prefill_logits(target.graphdef, target.state, np.asarray([prompt], np.int32),
                              np.asarray([len(prompt)], np.int32), cache)
    diffs, scale = [], 0.0
    for j, layer in enumerate(target.cfg.linear_layers):
        ref_conv = hf_cache.get_conv_state(layer, state_idx=0)[0].float().numpy()   # [C, K]
        ref_ssm = hf_cache.get_recurrent_state(layer, state_idx=0)[0].float().numpy()
        width = cache.conv_lbwc.shape[2]
        diffs += [max_abs_diff(np.asarray(cache.conv_lbwc[j, 0], np.float32), ref_conv[:, -width:].T, q),
                  max_abs_diff(np.asarray(cache.ssm_lbhkv[j, 0]), ref_ssm, q)]
        scale = max(scale, float(np.abs(ref_ssm).max()), float(np.abs(ref_conv).max()))
    return check("deltanet_state", max(diffs), rtol * max(1.0, scale))


def compare_target(model_dir: str, dtype: str = "float32", mesh_spec: str | None = None, seed: int = 0,
                   num_new_tokens: int = 8, reference_dir: str | None = None,
                   draft_dir: str | None = None, mtp_dir: str | None = None) -> dict:
    """Compares our JAX target with transformers on `model_dir` (docs/numerics.md lists the checks).

    Returns `{"ok", "checks": [{"name", "max_abs_diff", "tolerance", "ok"}, ...], "argmax_agreement",
    "greedy": {"ours", "hf"}, "prompt_lengths", "dtype", "float_quantile"}`. `mesh_spec` (e.g.
    `"tensor=4,data=2"`) places our params on that mesh (default: `make_mesh()`); `reference_dir` loads
    the transformers side from another directory (default `model_dir`); `draft_dir` adds the drafter
    checks (`drafter_checks`); `mtp_dir` a separate MTP head's (a `gemma4_assistant`: `assistant_check`;
    default: the native head `model_dir` carries, if any). Raises `ValueError` for a dtype without
    tolerances.
    """
    with quiet_transformers():
        return _compare_target(model_dir, dtype, mesh_spec, seed, num_new_tokens, reference_dir, draft_dir, mtp_dir)


@contextlib.contextmanager
def quiet_transformers():
    """transformers' warnings and progress bars off (its load report lists the `mtp.*` tensors it
    does not use, Qwen3.5 models announce their PyTorch fallback kernels): expected, so not shown."""
    from transformers.utils import logging as hf_logging     # lazy: transformers imports torch (seconds)

    level, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()


def _compare_target(model_dir: str, dtype: str, mesh_spec: str | None, seed: int, num_new_tokens: int,
                    reference_dir: str | None, draft_dir: str | None, mtp_dir: str | None) -> dict:
    """The body of `compare_target`."""
    import torch     # optional: the `test` extra
    from transformers import AutoModelForCausalLM     # needs torch (the `test` extra)

    dtype = jnp.dtype(dtype).name
    if dtype not in TOLERANCES:
        raise ValueError(f"no tolerances for dtype '{dtype}'; known: {', '.join(TOLERANCES)}")
    rtol, q, argmax_tol, greedy_tol = TOLERANCES[dtype]
    target = load_target(model_dir, dtype, make_mesh(mesh_spec) if mesh_spec else None)
    cfg = target.cfg
    hf_model = AutoModelForCausalLM.from_pretrained(reference_dir or model_dir, dtype=torch.float32).eval()
    prompts = make_prompts(cfg.vocab_size, cfg.max_position_embeddings, seed, reserve=num_new_tokens)
    ref = hf_reference(hf_model, prompts, num_new_tokens)
    tokens, lengths = right_pad(prompts)
    ours = jax_forward(target, tokens)
    cached = jax_cached_logits(target, tokens, lengths)

    def cat(rows):  # real (unpadded) positions of every prompt, concatenated: [sum(T), ...]
        return np.concatenate([r[:n] for r, n in zip(rows, lengths)])

    ref_logits = np.concatenate([r["logits"] for r in ref])
    our_logits = cat(ours["logits"])
    checks = [check("logits", max_abs_diff(our_logits, ref_logits, q), scaled_tolerance(rtol, ref_logits))]
    agree = float(np.mean(our_logits.argmax(-1) == ref_logits.argmax(-1)))
    checks.append(check("argmax_agreement", 1.0 - agree, argmax_tol))
    num_layers = cfg.num_hidden_layers
    for k in range(num_layers):
        mine = cat(ours["final"] if k == num_layers - 1 else ours["captured"][k])
        theirs = np.concatenate([r["hidden"][k] for r in ref])
        checks.append(check(f"hidden_layer_{k}", max_abs_diff(mine, theirs, q), scaled_tolerance(rtol, theirs)))
    checks.append(check("cached_decode", max_abs_diff(cat(cached), our_logits, q),
                        scaled_tolerance(rtol, ref_logits)))
    if cfg.linear_layers:
        checks.append(deltanet_state_check(target, hf_model, prompts[1], rtol, q))

    result = ARDecoder(target).generate(prompts, num_new_tokens, seed=seed, stop_ids=[])
    hf_gen = [r["generated"] for r in ref]
    mismatched = sum(sum(a != b for a, b in zip(o, h)) + abs(len(o) - len(h))
                     for o, h in zip(result.output_ids, hf_gen))
    checks.append(check("greedy_continuation", mismatched / (num_new_tokens * len(prompts)), greedy_tol))
    mtp_dir = mtp_dir or (model_dir if has_mtp(model_dir) else None)
    if mtp_dir and is_assistant_dir(mtp_dir):
        checks += assistant_check(target, hf_model, mtp_dir, prompts[1], rtol, q)
    elif mtp_dir and not cfg.is_mla:    # the MLA next-token layer: tests/test_deepseek.py's formula
        checks += mtp_check(target, hf_model, mtp_dir, prompts[1], rtol, q)
    if draft_dir:
        checks += drafter_checks(target, hf_model, draft_dir, prompts[1], rtol, q)
    return {"ok": all(c["ok"] for c in checks), "checks": checks, "argmax_agreement": agree,
            "greedy": {"ours": result.output_ids, "hf": hf_gen},
            "prompt_lengths": lengths.tolist(), "dtype": dtype, "float_quantile": q}


def format_table(report: dict) -> str:
    """A fixed-width table of the checks and a final `OK` / `FAILED: <names>` line.

    Example:
        >>> print(format_table({"ok": True, "checks": [check("logits", 1.5e-6, 1e-4)]}))
        check     max_abs_diff     tolerance  ok
        logits       1.500e-06     1.000e-04  yes
        OK
    """
    width = max([len("check")] + [len(c["name"]) for c in report["checks"]]) + 2
    lines = [f"{'check':<{width}}{'max_abs_diff':>14}{'tolerance':>14}  ok"]
    for c in report["checks"]:
        lines.append(f"{c['name']:<{width}}{c['max_abs_diff']:>14.3e}{c['tolerance']:>14.3e}  "
                     f"{'yes' if c['ok'] else 'NO'}")
    failed = [c["name"] for c in report["checks"] if not c["ok"]]
    lines.append("OK" if not failed else "FAILED: " + ", ".join(failed))
    return "\n".join(lines)


class mtp_tensors_expected:
    """Context: transformers' targets do not run `mtp.*` tensors and its load report lists them as
    UNEXPECTED (a coloured table on stderr); they are expected here, so they are left out of it.

    Example:
        >>> with mtp_tensors_expected():
        ...     pass
    """

    PATTERN = r"^mtp\."

    def __enter__(self):
        from transformers import PreTrainedModel     # needs torch (the `test` extra)
        self.saved = PreTrainedModel.__dict__.get("_keys_to_ignore_on_load_unexpected")
        PreTrainedModel._keys_to_ignore_on_load_unexpected = [*(self.saved or []), self.PATTERN]
        return self

    def __exit__(self, *exc):
        from transformers import PreTrainedModel     # needs torch (the `test` extra)
        PreTrainedModel._keys_to_ignore_on_load_unexpected = self.saved
        return False
