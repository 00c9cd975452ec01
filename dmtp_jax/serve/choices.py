"""A request's `n` choices: one HTTP request with `n` > 1 is `n` engine `Request`s of the same prompt
(`fan_out`: choice `i` seeded `seed + i`), submitted together (`Scheduler.submit_many`) and prefilled in
one call, one row each (`admission.keep_choices` keeps them in one group); `Choice` is one choice's
text, stop strings and logprobs as its events come back, `usage` the response's token counts (the
prompt once, the choices' completion tokens summed).

Example:
    >>> reqs = fan_out(Request([1, 2], 4, temperature=0.7, seed=5), 3)
    >>> [r.seed for r in reqs], len({r.choices_of for r in reqs}), reqs[1].prompt_ids is reqs[0].prompt_ids
    ([5, 6, 7], 1, False)
"""

from __future__ import annotations

from typing import Callable

from dmtp_jax.serve.logprobs import chat_logprobs, completion_logprobs
from dmtp_jax.serve.request import Request, acceptance_stats
from dmtp_jax.serve.text import TextStream
from dmtp_jax.serve.tool_calls import OutputParser, parse_output

__all__ = ["Choice", "fan_out", "merged_logprobs", "usage"]


def wrap_seed(seed: int) -> int:
    """`seed` wrapped into the 64-bit signed range (`seed + i` past 2**63 - 1 wraps).

    Example:
        >>> wrap_seed(2**63), wrap_seed(-1)
        (-9223372036854775808, -1)
    """
    return (seed + 2**63) % 2**64 - 2**63


def fan_out(req: Request, n: int) -> list[Request]:
    """`req` and `n - 1` copies of it (same prompt, sampling and limits), choice `i` seeded
    `seed + i` (wrapped to 64 bits), all marked as choices of one request (`choices_of`: the first's
    id). A greedy request's copies give its output `n` times."""
    if n == 1:
        return [req]
    req.choices_of = req.id
    copies = [Request(list(req.prompt_ids), req.max_tokens, temperature=req.temperature, top_p=req.top_p,
                      top_k=req.top_k, seed=wrap_seed(req.seed + i), stop_ids=req.stop_ids, logprobs=req.logprobs,
                      choices_of=req.id) for i in range(1, n)]
    return [req, *copies]


class Choice:
    """One choice's output as its events come: its text (`TextStream`: stop strings cut exactly),
    the logprobs not yet sent (`logprobs`), its `finish_reason`; a chat choice's message or deltas
    (`message`, `delta`: tool calls and reasoning split off when `parse` = (tool names, think) asks)."""

    def __init__(self, index: int, req: Request, decode: Callable, stops: list[str], token_str: Callable,
                 chat: bool, parse: tuple[set, bool] | None = None):
        self.index, self.req, self.token_str, self.chat = index, req, token_str, chat
        self.parse = parse if parse and (parse[0] or parse[1]) else None
        self.parser = OutputParser(*self.parse) if self.parse else None
        self.calls: list[dict] = []     # the tool calls its output made
        self.text = TextStream(decode, stops)
        self.stopping = False           # a stop string ended the text: its request is cancelled, ending
        self.pending = ""               # the text before the stop string, sent once the request ended
        self.first = True               # no chunk sent yet (chat's first delta carries the role)
        self._sent = [0, 0]             # output tokens whose logprobs were sent, their characters

    def completion_tokens(self) -> int:
        """Its tokens, through a stop string's (not past it)."""
        return self.text.stop_tokens if self.text.stopped else len(self.req.output_ids)

    def finish_reason(self) -> str | None:
        """A stop string ends the text, even in the round that reached max_tokens."""
        reason = "stop" if self.text.stopped or self.req.finish_reason in ("stop", "stop_string") \
            else self.req.finish_reason
        return "tool_calls" if reason == "stop" and self.calls else reason

    def message(self, text: str) -> dict:
        """The chat message of the whole output `text`."""
        if self.parse is None:
            return {"role": "assistant", "content": text}
        parts, self.calls = parse_output(text, *self.parse)
        return {"role": "assistant", "content": parts.get("content", None if self.calls else ""),
                **({"reasoning_content": parts["reasoning_content"]} if "reasoning_content" in parts else {}),
                **({"tool_calls": self.calls} if self.calls else {})}

    def delta(self, text: str, finished: bool) -> dict:
        """The chat delta of the next streamed `text` (the role in the first)."""
        if self.parser is None:
            d = {"content": text} if text or self.first else {}
        else:
            d = self.parser.add(text)
            for k, v in (self.parser.flush() if finished else {}).items():
                d[k] = d.get(k, "" if k != "tool_calls" else []) + v
            self.calls = self.parser.calls
        return {"role": "assistant", **d} if self.first else d

    def logprobs(self):
        """The logprobs of the tokens committed since the last call (through a stop string's), in the
        request's format; None when it asks for none or none came."""
        text, req, sent = self.text, self.req, self._sent
        end = min(len(text.ids), text.stop_tokens if text.stopped else len(text.ids))
        if req.logprobs is None or end <= sent[0]:
            return None
        ids, entries = text.ids[sent[0]:end], req.token_logprobs[sent[0]:end]
        sent[0] = end
        if self.chat:
            return chat_logprobs(ids, entries, self.token_str)
        out = completion_logprobs(ids, entries, self.token_str, sent[1])
        sent[1] += sum(len(t) for t in out["tokens"])
        return out


def merged_logprobs(parts: list, chat: bool):
    """One response's logprobs from its chunks' (`Choice.logprobs`, None ones left out)."""
    parts = [p for p in parts if p is not None]
    if chat:
        return {"content": [c for p in parts for c in p["content"]]}
    return {k: [x for p in parts for x in p[k]] for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}


def usage(choices: list[Choice], method: str) -> dict:
    """The response's `usage`: the prompt's tokens once, the choices' completion tokens summed, and the
    verify rounds and acceptance over all of them.

    Example:
        >>> reqs = fan_out(Request([1, 2, 3], 4), 2)
        >>> reqs[0].output_ids, reqs[1].output_ids = [5, 6], [7]
        >>> u = usage([Choice(i, r, str, [], str, False) for i, r in enumerate(reqs)], "ar")
        >>> u["prompt_tokens"], u["completion_tokens"], u["total_tokens"]
        (3, 3, 6)
    """
    prompt = len(choices[0].req.prompt_ids)
    completion = sum(c.completion_tokens() for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "dmtp": {"method": method, **acceptance_stats([a for c in choices for a in c.req.acceptance])}}
