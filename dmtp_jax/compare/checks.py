"""The comparison's check rows, tolerances and prompts (`dmtp_jax.compare`)."""

from __future__ import annotations

import numpy as np

TOLERANCES = {  # dtype -> (rtol of float checks, their position quantile, argmax, greedy mismatch)
    "float32": (1e-4, 1.0, 0.0, 0.0),
    "bfloat16": (5e-2, 0.99, 0.1, 1.0),
    "float16": (5e-2, 0.99, 0.1, 1.0),
}
DECODE_STEPS = 4


def check(name: str, max_abs_diff: float, tolerance: float) -> dict:
    """One check row. Example: `check("logits", 2e-6, 1e-4)["ok"]` is True."""
    diff = float(max_abs_diff)
    return {"name": name, "max_abs_diff": diff, "tolerance": float(tolerance),
            "ok": bool(np.isfinite(diff) and diff <= tolerance)}


def max_abs_diff(ours, ref, quantile: float = 1.0) -> float:
    """|ours - ref| maxed over the last axis, then the `quantile` over positions (1.0: the plain max);
    float64, inf on shape mismatch. Example: `max_abs_diff([[1, 2], [3, 4]], [[1, 2.5], [3, 4]])` = 0.5."""
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    if ours.shape != ref.shape:
        return float("inf")
    per_position = np.abs(ours - ref).reshape(-1, ours.shape[-1] if ours.ndim else 1).max(-1)
    return float(np.quantile(per_position, quantile)) if quantile < 1 else float(per_position.max())


def scaled_tolerance(rtol: float, ref) -> float:
    """`rtol * max(1, max |ref|)`. Example: `scaled_tolerance(1e-4, [[-30.0, 2.0]])` = 3e-3."""
    return rtol * max(1.0, float(np.max(np.abs(np.asarray(ref, np.float64)))))


def make_prompts(vocab_size: int, max_positions: int, seed: int = 0, reserve: int = 8,
                 lengths=(7, 33, 300)) -> list[list[int]]:
    """Random token-id prompts; every length is clipped so that `length + reserve <= max_positions`.

    Example:
        >>> [len(p) for p in make_prompts(128, 512, seed=0)]
        [7, 33, 300]
    """
    rng = np.random.default_rng(seed)
    lengths = [max(DECODE_STEPS + 1, min(n, max_positions - reserve)) for n in lengths]
    return [rng.integers(0, vocab_size, size=n).tolist() for n in lengths]


def right_pad(prompts: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """`([B, max_len] int32 tokens right-padded with 0, [B] lengths)`."""
    lengths = np.array([len(p) for p in prompts], np.int32)
    tokens = np.zeros((len(prompts), int(lengths.max())), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, :len(p)] = p
    return tokens, lengths
