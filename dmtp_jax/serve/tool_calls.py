"""Chat tools and reasoning: the request's `tools` / `tool_choice` checked (`offered_tools`), and the
assistant's output split as it streams (`OutputParser`): text in a leading `<think>...</think>` is
`reasoning_content` (only when the model's chat template uses think tags), each `<tool_call>` block
whose JSON names an offered function with object arguments is a `tool_calls` entry, the rest
`content` (an unparsable block stays in it). Text that might begin a tag is held back until decided.

Example:
    >>> p = OutputParser({"f"}, think=True)
    >>> out = p.add('<think>\\nhm\\n</think>\\n\\nok <tool_call>\\n{"name": "f", "arguments": {"x": 1}}\\n</tool_call>')
    >>> out["reasoning_content"], out["content"], out["tool_calls"][0]["function"]
    ('hm', 'ok ', {'name': 'f', 'arguments': '{"x": 1}'})
"""

from __future__ import annotations

import json
import uuid

from dmtp_jax.serve.protocol import ApiError
from dmtp_jax.serve.text import held_back

THINK_OPEN, THINK_CLOSE, CALL_OPEN, CALL_CLOSE = "<think>", "</think>", "<tool_call>", "</tool_call>"
TURN_END = "<|im_end|>"


def offered_tools(tools, tool_choice) -> list[dict] | None:
    """The function tools to render in the prompt (None: none offered), checked: a 400 naming `tools`
    for a malformed list, naming `tool_choice` for one this server cannot honour (`required` or a named
    function need constrained decoding).

    Example:
        >>> t = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
        >>> offered_tools(t, None) == t, offered_tools(t, "none"), offered_tools(None, "auto")
        (True, None, None)
        >>> offered_tools(t, "required")
        Traceback (most recent call last):
        ...
        dmtp_jax.serve.protocol.ApiError: tool_choice: 'required' needs the output constrained to the tools' schemas (constrained decoding), which this server does not yet support; use "auto" or "none"
    """
    if tools is not None:
        if not isinstance(tools, list):
            raise ApiError("tools: should be a list of function tools", param="tools")
        for i, tool in enumerate(tools):
            fn = tool.get("function") if isinstance(tool, dict) else None
            if not isinstance(fn, dict) or tool.get("type") != "function":
                raise ApiError(f"tools[{i}]: should be {{\"type\": \"function\", \"function\": {{...}}}}", param="tools")
            if not isinstance(fn.get("name"), str) or not fn["name"]:
                raise ApiError(f"tools[{i}].function.name: should be a non-empty string", param="tools")
            if not isinstance(fn.get("description", ""), str) or not isinstance(fn.get("parameters", {}), dict):
                raise ApiError(f"tools[{i}].function: description should be a string and parameters a JSON schema "
                               "object", param="tools")
    if tool_choice in (None, "auto", "none"):
        return tools or None if tool_choice != "none" else None
    what = repr(tool_choice) if isinstance(tool_choice, str) else "a named function"
    if tool_choice != "required" and not isinstance(tool_choice, dict):
        raise ApiError(f"tool_choice: should be \"auto\", \"none\", \"required\" or a named function, got "
                       f"{str(tool_choice)[:40]}", param="tool_choice")
    raise ApiError(f"tool_choice: {what} needs the output constrained to the tools' schemas (constrained decoding), "
                   "which this server does not yet support; use \"auto\" or \"none\"", param="tool_choice")


def tool_names(tools: list[dict] | None) -> set[str]:
    """The names of the offered function tools."""
    return {t["function"]["name"] for t in tools or ()}


def tool_call(block: str, names: set[str]) -> dict | None:
    """The OpenAI `tool_calls` entry of a `<tool_call>` block's inside, None when it is not JSON with a
    `name` among `names` and object `arguments`.

    Example:
        >>> tool_call('{"name": "g", "arguments": {}}', {"f"}), tool_call('{"name": "f"', {"f"})
        (None, None)
    """
    try:
        call = json.loads(block)
    except ValueError:
        return None
    if not isinstance(call, dict) or call.get("name") not in names or not isinstance(call.get("arguments"), dict):
        return None
    return {"id": "call_" + uuid.uuid4().hex, "type": "function",
            "function": {"name": call["name"], "arguments": json.dumps(call["arguments"], ensure_ascii=False)}}


class OutputParser:
    """One choice's output text split as it comes: `add(text)` and, at the end, `flush()` return the
    delta to send (`reasoning_content`, `content`, `tool_calls` keys, each only when non-empty);
    `calls` holds every tool call made. `names`: the offered functions (empty: no tool parsing);
    `think`: split a leading `<think>...</think>` off as reasoning."""

    def __init__(self, names: set[str], think: bool):
        self.names, self.think = names, think
        self.mode = "start" if think else "content"
        self.buf = ""
        self.calls: list[dict] = []
        self.reasoning_started, self.reasoning_hold = False, ""    # trailing newlines of the reasoning
        self.after_think = False            # the content follows a think block: its leading newlines go
        self.content_hold = ""              # whitespace-only content, dropped at the end once tools were called

    def add(self, text: str) -> dict:
        self.buf += text
        out = {"reasoning_content": "", "content": "", "tool_calls": []}
        while self._step(out):
            pass
        return {k: v for k, v in out.items() if v}

    def flush(self) -> dict:
        """The delta of what was held back, once the output ended."""
        out = {"reasoning_content": "", "content": "", "tool_calls": []}
        rest, self.buf = self.buf, ""
        if self.mode == "think":
            self._reasoning(out, rest, final=True)
        else:
            self._content(out, rest)
        if not self.calls:
            out["content"] += self.content_hold
        self.content_hold = ""
        return {k: v for k, v in out.items() if v}

    def _step(self, out: dict) -> bool:
        """Consumes what can be decided of `buf`; True when it should be called again."""
        buf = self.buf
        if self.mode == "start":
            head = buf.lstrip()
            if head.startswith(THINK_OPEN):
                self.buf, self.mode = head[len(THINK_OPEN):], "think"
                return True
            if not head or THINK_OPEN.startswith(head):
                return False                # might still open a think block
            self.mode = "content"
            return True
        if self.mode == "think":
            end = buf.find(THINK_CLOSE)
            if end >= 0:
                self._reasoning(out, buf[:end], final=True)
                self.buf, self.mode, self.after_think = buf[end + len(THINK_CLOSE):], "content", True
                return True
            safe = len(buf) - held_back(buf, [THINK_CLOSE])
            self._reasoning(out, buf[:safe], final=False)
            self.buf = buf[safe:]
            return False
        if self.mode == "content":
            start = buf.find(CALL_OPEN) if self.names else -1
            if start >= 0:
                self._content(out, buf[:start])
                self.buf, self.mode = buf[start:], "call"
                return True
            safe = len(buf) - (held_back(buf, [CALL_OPEN]) if self.names else 0)
            self._content(out, buf[:safe])
            self.buf = buf[safe:]
            return False
        end = buf.find(CALL_CLOSE)            # mode "call": a block opened, decided once it closes
        if end < 0:
            return False
        block, self.buf, self.mode = buf[:end + len(CALL_CLOSE)], buf[end + len(CALL_CLOSE):], "content"
        call = tool_call(block[len(CALL_OPEN):-len(CALL_CLOSE)], self.names)
        if call is None:
            self._content(out, block)
        else:
            out["tool_calls"].append({"index": len(self.calls), **call})
            self.calls.append(call)
        return True

    def _reasoning(self, out: dict, text: str, final: bool) -> None:
        text = self.reasoning_hold + text
        if not self.reasoning_started:
            text = text.lstrip("\n")
            self.reasoning_started = bool(text)
        body = text.rstrip("\n")
        self.reasoning_hold = "" if final else text[len(body):]
        out["reasoning_content"] += body

    def _content(self, out: dict, text: str) -> None:
        if self.after_think:
            text = text.lstrip("\n")
            self.after_think = not text
        text = self.content_hold + text
        if text.strip():
            out["content"] += text
            self.content_hold = ""
        else:
            self.content_hold = text


def parse_output(text: str, names: set[str], think: bool) -> tuple[dict, list[dict]]:
    """The whole output's `(delta, calls)` (as streamed deltas joined: `OutputParser` on one chunk).

    Example:
        >>> parse_output("a <tool_call>oops</tool_call>", {"f"}, False)
        ({'content': 'a <tool_call>oops</tool_call>'}, [])
    """
    parser = OutputParser(names, think)
    first, last = parser.add(text), parser.flush()
    merged = {k: first.get(k, "") + last.get(k, "") for k in ("reasoning_content", "content")}
    return {k: v for k, v in merged.items() if v}, parser.calls


def chat_stops(tokenizer) -> list[str]:
    """Stop strings a chat response gets from the model's template: ChatML's `<|im_end|>` where the
    vocabulary has no token for it (the demo's: its EOS token is `<|endoftext|>`)."""
    template = str(getattr(tokenizer, "chat_template", None) or "")
    return [TURN_END] if TURN_END in template and TURN_END not in tokenizer.get_vocab() else []


def uses_think(tokenizer) -> bool:
    """Whether the model's chat template writes think tags (its output's reasoning is then split off)."""
    return THINK_OPEN in str(getattr(tokenizer, "chat_template", None) or "")
