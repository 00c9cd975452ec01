"""Output text of a request as its tokens arrive: `TextStream.add(tokens)` returns the text safe to
send now (before the first stop string, less a tail that could begin one or is an incomplete UTF-8
character), so stop strings are cut exactly across blocks; `stop_tokens` counts the tokens through
the one that completed the stop string (the request's completion tokens, not those past it).

Example:
    >>> ts = TextStream(lambda ids: "".join(map(chr, ids)), ["END"])
    >>> ts.add([ord(c) for c in "abcE"]), ts.add([ord(c) for c in "Nx"]), ts.add([ord(c) for c in "ENDzz"])
    ('abc', 'ENx', '')
    >>> ts.stopped, ts.stop_tokens
    (True, 9)
"""

from __future__ import annotations


def held_back(text: str, stops: list[str]) -> int:
    """How many trailing characters of `text` might begin a stop string (or be a partial UTF-8
    character) and must wait for more tokens.

    Example:
        >>> held_back("x = 1\\n#", ["\\n##"]), held_back("abc", ["\\n##"])
        (2, 0)
    """
    hold = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), hold, -1):
            if stop.startswith(text[-k:]):
                hold = k
                break
    while hold < len(text) and text[len(text) - hold - 1] == "\ufffd":
        hold += 1
    return hold


class TextStream:
    """One request's output text: `decode(ids) -> str` is the tokenizer's, `stops` its stop strings."""

    def __init__(self, decode, stops: list[str] | None = None):
        self.decode, self.stops = decode, [s for s in (stops or []) if s]
        self.ids: list[int] = []
        self.sent = 0               # characters of the decoded text already returned
        self.stopped = False
        self.stop_tokens = 0        # once stopped: the tokens up to the one that completed the stop string

    def add(self, tokens) -> str:
        """The new safe text after appending `tokens` ("" once stopped)."""
        if self.stopped:
            return ""
        before = len(self.ids)
        self.ids.extend(tokens)
        text = self.decode(self.ids)
        hits = [(i, s) for i, s in ((text.find(s, max(0, self.sent - len(s))), s) for s in self.stops) if i >= 0]
        if hits:
            cut, stop = min(hits)
            self.stopped = True
            self.stop_tokens = next((n for n in range(before + 1, len(self.ids) + 1)
                                     if self.decode(self.ids[:n]).startswith(stop, cut)), len(self.ids))
        else:
            cut = len(text) - held_back(text, self.stops)
        delta = text[self.sent:cut] if cut > self.sent else ""
        self.sent = max(self.sent, cut)
        return delta

    def flush(self) -> str:
        """The held-back tail, once the request ended without a stop string."""
        if self.stopped:
            return ""
        text = self.decode(self.ids)
        delta, self.sent = text[self.sent:], len(text)
        return delta


def max_token_chars(tokenizer) -> int:
    """An upper bound on the characters one token decodes to (the longest token string of the vocabulary).

    Example:
        >>> class Tok:
        ...     def get_vocab(self): return {"a": 0, "Ġthe": 1}
        >>> max_token_chars(Tok())
        4
    """
    vocab = tokenizer.get_vocab()
    return max((len(t) for t in vocab), default=1) or 1
