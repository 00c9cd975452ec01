"""A request's logprobs: the target's raw log-probabilities at each emitted token (every round and
prefill computes them: `decode/logprobs.py`) kept per output token (`keep_logprobs`) for a request that
asks, and OpenAI's two formats of them: completions' (`completion_logprobs`) and chat's (`chat_logprobs`).

Example:
    >>> import numpy as np
    >>> from dmtp_jax.decode.logprobs import TokenLogprobs
    >>> from dmtp_jax.serve.request import Request
    >>> req = Request([1], 2, logprobs=1)
    >>> keep_logprobs(req, TokenLogprobs(np.array([-0.5]), np.array([[7, 3]]), np.array([[-0.5, -1.0]])), 1)
    >>> completion_logprobs([7], req.token_logprobs, lambda t: f"<{t}>")
    {'tokens': ['<7>'], 'token_logprobs': [-0.5], 'top_logprobs': [{'<7>': -0.5}], 'text_offset': [0]}
"""

from __future__ import annotations

from typing import Callable

from dmtp_jax.decode.logprobs import MAX_TOP_LOGPROBS, TokenLogprobs

__all__ = ["MAX_TOP_LOGPROBS", "chat_logprobs", "completion_logprobs", "keep_logprobs", "slot_logprobs"]
FLOOR = -9999.0     # a logprob below this is sent as it (JSON has no -inf), as vLLM does


def slot_logprobs(lp: TokenLogprobs | None, row: int, k: int, got: int) -> TokenLogprobs | None:
    """Row `row`'s first `got` slots of dispatch round `k` of a `RoundBank.run`'s host logprobs (None: none)."""
    if lp is None:
        return None
    return TokenLogprobs(lp.logprob[row, k, :got], lp.top_ids[row, k, :got], lp.top_logprobs[row, k, :got])


def keep_logprobs(req, lp: TokenLogprobs | None, count: int) -> None:
    """Appends to `req.token_logprobs`, when it asks for logprobs, the first `count` tokens' `(logprob,
    [(id, logprob)] x req.logprobs)` (None each where `lp` is None: the tokens stay aligned with
    `req.output_ids`)."""
    if req.logprobs is None or count <= 0:
        return
    if lp is None:
        req.token_logprobs.extend([None] * count)
        return
    n = req.logprobs
    for t in range(count):
        top = [(int(i), max(float(v), FLOOR)) for i, v in zip(lp.top_ids[t][:n], lp.top_logprobs[t][:n])]
        req.token_logprobs.append((max(float(lp.logprob[t]), FLOOR), top))


def completion_logprobs(ids, entries, token_str: Callable[[int], str], offset: int = 0) -> dict:
    """OpenAI completions' `logprobs` of output tokens `ids` and their kept `entries`: `tokens`,
    `token_logprobs`, `top_logprobs` (token -> logprob, with the chosen token's, as vLLM) and
    `text_offset` (each token's character offset in the output text, from `offset`)."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for tid, entry in zip(ids, entries):
        text = token_str(tid)
        out["tokens"].append(text)
        out["text_offset"].append(offset)
        offset += len(text)
        if entry is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        lp, top = entry
        out["token_logprobs"].append(lp)
        tops = {}
        for i, v in top:
            tops.setdefault(token_str(i), v)
        tops.setdefault(text, lp)
        out["top_logprobs"].append(tops)
    return out


def chat_logprobs(ids, entries, token_str: Callable[[int], str]) -> dict:
    """OpenAI chat's `logprobs`: `{"content": [{token, logprob, bytes, top_logprobs: [{token, logprob,
    bytes}]}]}` of output tokens `ids` and their kept `entries`."""
    def one(tid, lp):
        text = token_str(tid)
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8", "replace"))}
    content = []
    for tid, entry in zip(ids, entries):
        lp, top = entry if entry is not None else (None, [])
        content.append({**one(tid, lp), "top_logprobs": [one(i, v) for i, v in top]})
    return {"content": content}
