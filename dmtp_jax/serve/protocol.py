"""The OpenAI request bodies and their strict checks (finite numbers, 64-bit seeds, ids in
`[0, vocab)`, valid Unicode, capped stop strings, prompts that cannot fit refused untokenised),
applied before a request reaches the scheduler, and OpenAI's error object.

Example:
    >>> body = CompletionBody(prompt=[1, 2], max_tokens=4, seed=7)
    >>> one_prompt(body.prompt), body.seed
    ([1, 2], 7)
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

from dmtp_jax.serve.request import Request

Number = Annotated[Union[StrictInt, StrictFloat], Field(allow_inf_nan=False)]
Seed = Annotated[StrictInt, Field(ge=-2**63, lt=2**63)]
TokenIds = list[StrictInt]


class ApiError(Exception):
    """An error answered as OpenAI JSON with `status`."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.kind, self.code = status, param, kind, code


def error_body(message: str, kind: str = "invalid_request_error", param=None, code=None) -> dict:
    """OpenAI's error object `{"error": {"message", "type", "param", "code"}}`."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


@dataclasses.dataclass(frozen=True)
class ServerLimits:
    """What one request may ask of the server (each has an `infer.py serve` flag)."""
    max_body_bytes: int = 16 * 2**20        # request body; 413 above (Content-Length or as it arrives)
    max_waiting: int = 256                  # requests queued beyond the running rows; 429 above
    max_stop_strings: int = 16
    max_stop_chars: int = 256               # characters per stop string
    header_timeout_s: float = 10.0          # a connection must send a whole request head within this


class CompletionBody(BaseModel):
    """The fields of `/v1/completions` (others are ignored, as OpenAI's server does with unknown ones)."""
    model_config = ConfigDict(extra="ignore")
    model: StrictStr | None = None
    prompt: StrictStr | TokenIds | list[StrictStr] | list[TokenIds] | None = None
    max_tokens: StrictInt | None = 16
    temperature: Number | None = 1.0
    top_p: Number | None = 1.0
    top_k: StrictInt | None = 0
    seed: Seed | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stream: StrictBool = False
    n: StrictInt = 1
    logprobs: Any = None
    echo: StrictBool = False


class ChatBody(CompletionBody):
    messages: list[dict[str, Any]]
    max_completion_tokens: StrictInt | None = None
    max_tokens: StrictInt | None = None


def one_prompt(prompt) -> str | list[int]:
    """The request's single prompt (a string, token ids, or a list of one of them).

    Example:
        >>> one_prompt(["hi"]), one_prompt([1, 2])
        ('hi', [1, 2])
    """
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise ApiError("only one prompt per request is supported (n = 1, one prompt)", param="prompt")
        prompt = prompt[0]
    if prompt is None or len(prompt) == 0:
        raise ApiError("prompt must not be empty", param="prompt")
    return prompt


def check_text(value, param: str) -> None:
    """Raises a 400 when a string anywhere in `value` (strings, lists, dicts) is not valid Unicode."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ApiError(f"{param}: not valid Unicode text (a lone surrogate at character {e.start})",
                           param=param) from None
    elif isinstance(value, dict):
        for v in value.values():
            check_text(v, param)
    elif isinstance(value, list):
        for v in value:
            check_text(v, param)


def check_token_ids(ids: list[int], vocab_size: int) -> None:
    """Raises a 400 naming the first id outside `[0, vocab_size)`."""
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ApiError(f"prompt: token id {bad} is outside the vocabulary [0, {vocab_size})", param="prompt")


def check_prompt_chars(chars: int, max_model_len: int, max_token_chars: int) -> None:
    """Raises a 413 for a text prompt of `chars` characters that needs more than `max_model_len` tokens
    however tokenised (no token is longer than `max_token_chars`)."""
    if chars > max_model_len * max_token_chars:
        raise ApiError(f"prompt: {chars} characters cannot fit the maximum model length {max_model_len} "
                       f"(no token is longer than {max_token_chars} characters)", 413, param="prompt")


def stops_of(body: CompletionBody, limits: ServerLimits) -> list[str]:
    """The request's stop strings, checked against the limits."""
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stops) > limits.max_stop_strings:
        raise ApiError(f"stop: at most {limits.max_stop_strings} stop strings (--max-stop-strings), got {len(stops)}",
                       param="stop")
    longest = max((len(s) for s in stops), default=0)
    if longest > limits.max_stop_chars:
        raise ApiError(f"stop: a stop string has at most {limits.max_stop_chars} characters (--max-stop-chars), "
                       f"got {longest}", param="stop")
    check_text(stops, "stop")
    return stops


def request_of(body: CompletionBody, prompt_ids: list[int], max_tokens: int | None, *, model_name: str,
               max_model_len: int, vocab_size: int) -> Request:
    """The engine `Request` of a checked body and its prompt's token ids.

    Example:
        >>> request_of(CompletionBody(max_tokens=4, top_k=-1), [1, 2], 4, model_name="m", max_model_len=64,
        ...            vocab_size=10).top_k
        0
    """
    if body.model not in (None, model_name):
        raise ApiError(f"the model '{body.model}' does not exist; this server serves '{model_name}'", 404,
                       param="model", kind="not_found_error")
    if body.n != 1:
        raise ApiError(f"only n = 1 is supported, got {body.n}", param="n")
    if body.logprobs not in (None, False, 0):
        raise ApiError("logprobs are not supported", param="logprobs")
    check_token_ids(prompt_ids, vocab_size)
    if max_tokens is None:
        max_tokens = max_model_len - len(prompt_ids)
    if max_tokens < 1:
        raise ApiError(f"max_tokens must be >= 1, got {max_tokens}", param="max_tokens")
    if len(prompt_ids) + max_tokens > max_model_len:
        raise ApiError(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) exceeds the maximum "
                       f"model length {max_model_len}", 413, param="prompt")
    temperature = 1.0 if body.temperature is None else float(body.temperature)
    top_p = 1.0 if body.top_p is None else float(body.top_p)
    if temperature < 0:
        raise ApiError(f"temperature must be >= 0, got {temperature}", param="temperature")
    if not 0 < top_p <= 1:
        raise ApiError(f"top_p must be in (0, 1], got {top_p}", param="top_p")
    if body.top_k is not None and body.top_k < -1:
        raise ApiError(f"top_k must be -1 or 0 (off) or a positive k, got {body.top_k}", param="top_k")
    top_k = body.top_k if body.top_k and 0 < body.top_k < vocab_size else 0   # -1 / 0 / None / >= V: off
    return Request(list(prompt_ids), int(max_tokens), temperature=temperature, top_p=top_p, top_k=int(top_k),
                   seed=int(body.seed or 0))
