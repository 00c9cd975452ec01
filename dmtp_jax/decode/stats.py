"""Acceptance statistics, with the paper's definitions, in one place.

An acceptance length is the tokens one verify round commits: accepted drafts + the bonus (1 ..
block). With `hist[k]` = rounds that accepted exactly k drafts: per-request mean (mean of each
request's mean); per-verify mean `1 + sum(k * hist[k]) / sum(hist)`; first-candidate acceptance
`1 - hist[0] / sum(hist)`; `P(L >= k)`, k = 1..block-1; conditional `P(L >= k) / P(L >= k-1)`.

Example:
    >>> s = acceptance_stats([[3, 1, 8], [2]], block_size=8)
    >>> s["histogram"][:3], round(s["per_verify_acceptance_length"], 3)
    ([1, 1, 1], 3.5)
"""

from __future__ import annotations

import numpy as np

from dmtp_jax.decode.auto import describe_verdict


def acceptance_stats(acceptance_lengths: list[list[int]], block_size: int) -> dict:
    """Statistics of per-row acceptance-length sequences (see module docstring)."""
    n_draft = block_size - 1
    hist = np.zeros(block_size, np.int64)
    for row in acceptance_lengths:
        for length in row:
            if not 1 <= length <= block_size:
                raise ValueError(f"acceptance length {length} outside [1, {block_size}]")
            hist[length - 1] += 1
    rounds = int(hist.sum())
    if rounds == 0:
        return {"histogram": hist.tolist(), "rounds": 0}
    at_least = np.array([hist[k:].sum() / rounds for k in range(1, n_draft + 1)])
    prev = np.concatenate([[1.0], at_least[:-1]])
    conditional = np.where(prev > 0, at_least / np.maximum(prev, 1e-12), 0.0)
    per_request = [float(np.mean(r)) for r in acceptance_lengths if r]
    return {
        "histogram": hist.tolist(),
        "rounds": rounds,
        "per_request_acceptance_length": float(np.mean(per_request)),
        "per_verify_acceptance_length": float(1 + (np.arange(block_size) * hist).sum() / rounds),
        "first_candidate_acceptance": float(1 - hist[0] / rounds),
        "cumulative_acceptance": at_least.tolist(),
        "conditional_acceptance": conditional.tolist(),
    }


def first_candidate_by_source(acceptance_lengths: list[list[int]], t1_from_mtp: list[list[bool]]) -> dict:
    """dmtp-adaptive's split: the fraction of rounds whose first candidate was MTP's, and each kind's
    first-candidate acceptance and tokens per verify (None when none ran)."""
    split: dict = {True: [], False: []}
    for lengths, sources in zip(acceptance_lengths, t1_from_mtp):
        for length, from_mtp in zip(lengths, sources):
            split[bool(from_mtp)].append(length)
    rounds = len(split[True]) + len(split[False])
    out = {"mtp_t1_fraction": len(split[True]) / rounds if rounds else None}
    for name, from_mtp in (("mtp", True), ("drafter", False)):
        got = np.asarray(split[from_mtp])
        out[f"first_candidate_acceptance_{name}_t1"] = float(np.mean(got > 1)) if got.size else None
        out[f"per_verify_acceptance_length_{name}_t1"] = float(np.mean(got)) if got.size else None
    return out


def format_stats(stats: dict) -> str:
    """`generate`'s stats as the lines it prints on stderr: tokens, forwards, speed; acceptance; the
    exactness probe's verdict.

    Example:
        >>> print(format_stats({"method": "ar", "new_tokens": 8, "target_forwards": 8, "ttft_s": 0.01,
        ...                     "decode_tokens_per_s": 90.0, "compiles": 2}))
        method=ar new_tokens=8 target_forwards=8 ttft=0.010s decode=90.0 tok/s compiles=2
    """
    line = ("method={method} new_tokens={new_tokens} target_forwards={target_forwards} "
            "ttft={ttft_s:.3f}s decode={decode_tokens_per_s:.1f} tok/s compiles={compiles}").format(**stats)
    if "draft_head" in stats:
        line += f" draft_head={stats['draft_head']}"
    if "per_verify_acceptance_length" in stats:
        line += ("\nacceptance: per-request {per_request_acceptance_length:.3f} per-verify "
                 "{per_verify_acceptance_length:.3f} first-candidate {first_candidate_acceptance:.3f} "
                 "histogram {histogram}").format(**stats)
        line += "\nconditional acceptance by position: " + " ".join(
            f"{p:.2f}" for p in stats["conditional_acceptance"])
    if "auto" in stats:
        line += "\nauto, " + describe_verdict(stats["auto"])
    probe = stats.get("exactness_probe")
    if probe:
        line += (f"\nexactness probe: {'exact' if probe['exact'] else 'NOT exact'} ({probe['width']}-token block, "
                 f"{probe['positions']} positions, {probe['backend']} {probe['dtype']}) -> {probe['decision']}"
                 + (f" instead of {stats['declined_method']}" if stats.get("declined_method") else ""))
    return line
