"""The OpenAI request bodies and their strict checks (numbers finite as the engine's float32, 64-bit
seeds, ids in `[0, vocab)`, valid Unicode, capped stop strings, prompts that cannot fit refused
untokenised, fields that would change the output refused, unknown ones logged), applied before a
request reaches the scheduler, and OpenAI's error object: every error names its field (`param`).

Example:
    >>> body = CompletionBody(prompt=[1, 2], max_tokens=4, seed=7)
    >>> one_prompt(body.prompt), body.seed
    ([1, 2], 7)
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Annotated, Any, Union

import numpy as np
from pydantic import (BaseModel, ConfigDict, Discriminator, Field, StrictBool, StrictFloat, StrictInt, StrictStr, Tag,
                      ValidationError)

from dmtp_jax.decode.logprobs import MAX_TOP_LOGPROBS
from dmtp_jax.serve.request import Request

log = logging.getLogger(__name__)
Number = Annotated[StrictFloat, Field(allow_inf_nan=False)]       # an int is a number too
Seed = Annotated[StrictInt, Field(ge=-2**63, lt=2**63)]
TokenIds = list[StrictInt]


def prompt_kind(value) -> str | None:
    """Which of the prompt's four forms `value` is (one branch validated: a bad 3 M-id list costs one
    error, not one per id and form)."""
    if isinstance(value, str):
        return "text"
    if isinstance(value, list):
        first = value[0] if value else 0
        return "texts" if isinstance(first, str) else "id_lists" if isinstance(first, list) else "ids"
    return None


PROMPT_FORMS = ("text", "ids", "texts", "id_lists")
Prompt = Annotated[Union[Annotated[StrictStr, Tag("text")], Annotated[TokenIds, Tag("ids")],
                         Annotated[list[StrictStr], Tag("texts")], Annotated[list[TokenIds], Tag("id_lists")]],
                   Discriminator(prompt_kind, custom_error_type="prompt_type",
                                 custom_error_message="should be a string, token ids, or a list of one of them")]


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
    body_timeout_s: float = 30.0            # ... and a whole body within this of its head; 408 after


class CompletionBody(BaseModel):
    """The fields of `/v1/completions`; others are kept in `model_extra` for `check_unsupported`."""
    model_config = ConfigDict(extra="allow")
    model: StrictStr | None = None
    prompt: Prompt | None = None
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
    top_logprobs: Any = None
    max_completion_tokens: StrictInt | None = None
    max_tokens: StrictInt | None = None
    tools: Any = None                   # checked by `tool_calls.offered_tools`
    tool_choice: Any = None


def one_prompt(prompt) -> str | list[int]:
    """The request's single prompt (a string, token ids, or a list of one of them).

    Example:
        >>> one_prompt(["hi"]), one_prompt([1, 2])
        ('hi', [1, 2])
    """
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise ApiError("only one prompt per request is supported (n choices of it are)", param="prompt")
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


# fields this server does not implement, each with the values that leave the output unchanged: any
# other value is a 400 (vLLM's and OpenAI's servers would answer differently)
UNSUPPORTED = {"best_of": (None, 1), "logit_bias": (None, {}), "presence_penalty": (None, 0, 0.0),
               "frequency_penalty": (None, 0, 0.0), "repetition_penalty": (None, 1, 1.0), "suffix": (None, ""),
               "min_p": (None, 0, 0.0), "min_tokens": (None, 0), "ignore_eos": (None, False),
               "top_logprobs": (None, 0), "response_format": (None, {"type": "text"}),
               "stop_token_ids": (None, []), "guided_json": (None,), "guided_regex": (None,),
               "guided_choice": (None,), "guided_grammar": (None,)}
QUIET = frozenset({"user", "stream_options", "parallel_tool_calls", "metadata", "store"})
_logged: set[str] = set()


def check_unsupported(body: BaseModel) -> None:
    """A 400 naming the first `UNSUPPORTED` field given a value that would change the output; unknown
    fields are ignored, each name logged once (`QUIET` ones, which change nothing, never).

    Example:
        >>> check_unsupported(CompletionBody(prompt=[1], presence_penalty=0.0, user="u"))
        >>> check_unsupported(CompletionBody(prompt=[1], best_of=2))
        Traceback (most recent call last):
        ...
        dmtp_jax.serve.protocol.ApiError: best_of: not supported by this server (only null or 1; n gives several choices), got 2
    """
    unknown = []
    for name, value in (body.model_extra or {}).items():
        if name in UNSUPPORTED:
            neutral = UNSUPPORTED[name]
            if not any(value == v and type(value) is type(v) for v in neutral):
                allowed = " or ".join("null" if v is None else repr(v) for v in neutral)
                hint = "; n gives several choices" if name == "best_of" else ""
                raise ApiError(f"{name}: not supported by this server (only {allowed}{hint}), got {str(value)[:40]}",
                               param=name)
        elif name not in QUIET and name not in _logged and len(_logged) < 256:
            unknown.append(name)
    if unknown:
        _logged.update(unknown)
        log.warning("ignored request fields this server does not know: %s", ", ".join(sorted(unknown)))


def max_body_values(max_model_len: int, token_chars: int, limits: ServerLimits) -> int:
    """The most commas a useful request body holds: a prompt of `max_model_len` tokens (ids, or text
    of at most `token_chars` characters a token, two commas a chat message), the stop strings, and
    the other fields. A body holding more is refused before it is parsed (`parse_body`)."""
    return max_model_len * (max(1, token_chars) + 2) + limits.max_stop_strings * limits.max_stop_chars + 4096


def parse_body(model: type[BaseModel], raw: bytes, max_values: int):
    """`raw` JSON as `model`: a 413 when it holds more than `max_values` commas (counted at C speed,
    before any parsing: a 3 M-id body costs milliseconds), a 400 naming the field of the first error.

    Example:
        >>> parse_body(CompletionBody, b'{"prompt": [1, 2], "top_k": "5"}', 100)
        Traceback (most recent call last):
        ...
        dmtp_jax.serve.protocol.ApiError: top_k: Input should be a valid integer
    """
    commas = raw.count(b",")
    if commas > max_values:
        raise ApiError(f"the request body holds {commas} values, more than any request to this server can use "
                       f"({max_values})", 413, param="body")
    try:
        return model.model_validate_json(raw)
    except ValidationError as e:
        raise validation_error(e.errors(include_url=False, include_input=False)) from None


def validation_error(errors: list[dict]) -> ApiError:
    """A 400 for pydantic's first error, its `param` the field's path (the prompt's form tags and
    union members left out).

    Example:
        >>> validation_error([{"type": "float_type", "loc": ("body", "temperature"), "msg": "Input should be "
        ...                    "a valid number"}]).param
        'temperature'
    """
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        return ApiError("the request body is not valid JSON", param="body")
    skip = {"body", "int", "float", "str", "bool", *PROMPT_FORMS}
    loc = [str(x) for x in first.get("loc", ()) if str(x) not in skip and "[" not in str(x)]
    param = ".".join(loc) or None
    msg = first.get("msg", "invalid request")
    if first.get("type") == "model_attributes_type":
        msg = "the request body should be a JSON object"
    return ApiError(f"{param}: {msg}" if param else msg, param=param)


def check_float32(value: float, param: str) -> float:
    """`value` as the engine holds it (float32): a 400 naming `param` when that is not finite or a
    positive value rounds to 0 (1e308 would be inf: top-k and top-p would then do nothing).

    Example:
        >>> check_float32(0.7, "temperature"), check_float32(0.0, "temperature")
        (0.7, 0.0)
    """
    held = np.float32(value) if abs(value) < 1e39 else np.float32(np.inf)     # no overflow warning
    if not np.isfinite(held) or (value > 0 and held == 0):
        info = np.finfo(np.float32)
        raise ApiError(f"{param}: {value} does not fit float32, the engine's precision (at most "
                       f"{float(info.max):.4g}; a positive value at least {float(info.smallest_subnormal):.2g})",
                       param=param)
    return value


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
               max_model_len: int, vocab_size: int, max_top_k: int | None = None, max_n: int = 1) -> Request:
    """The engine `Request` of a checked body and its prompt's token ids (lengths checked before ids:
    a long prompt costs no scan). A prompt alone past `max_model_len` is a 413, prompt + `max_tokens`
    past it a 400 (as vLLM); `max_top_k`: the engine's top-k search width (`--max-top-k`); `max_n`: the
    most choices (`n`) a request may ask (the engine's rows; `serve/choices.py` makes them).

    Example:
        >>> request_of(CompletionBody(max_tokens=4, top_k=-1), [1, 2], 4, model_name="m", max_model_len=64,
        ...            vocab_size=10).top_k
        0
    """
    if body.model not in (None, model_name):
        raise ApiError(f"the model '{body.model}' does not exist; this server serves '{model_name}'", 404,
                       param="model", kind="not_found_error")
    if not 1 <= body.n <= max_n:
        raise ApiError(f"n: the choices of one request must be in [1, {max_n}] (--max-batch-size: they run "
                       f"side by side), got {body.n}", param="n")
    logprobs = logprobs_of(body)
    check_unsupported(body)
    if len(prompt_ids) >= max_model_len:
        raise ApiError(f"prompt: {len(prompt_ids)} tokens leave no room below the maximum model length "
                       f"{max_model_len}", 413, param="prompt")
    if max_tokens is None:
        max_tokens = max_model_len - len(prompt_ids)
    if max_tokens < 1:
        raise ApiError(f"max_tokens must be >= 1, got {max_tokens}", param="max_tokens")
    if len(prompt_ids) + max_tokens > max_model_len:
        raise ApiError(f"max_tokens: prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) exceeds the "
                       f"maximum model length {max_model_len}", param="max_tokens")
    check_token_ids(prompt_ids, vocab_size)
    temperature = check_float32(1.0 if body.temperature is None else float(body.temperature), "temperature")
    top_p = check_float32(1.0 if body.top_p is None else float(body.top_p), "top_p")
    if temperature < 0:
        raise ApiError(f"temperature must be >= 0, got {temperature}", param="temperature")
    if not 0 < top_p <= 1:
        raise ApiError(f"top_p must be in (0, 1], got {top_p}", param="top_p")
    if body.top_k is not None and body.top_k < -1:
        raise ApiError(f"top_k must be -1 or 0 (off) or a positive k, got {body.top_k}", param="top_k")
    if max_top_k is not None and body.top_k and max_top_k < body.top_k < vocab_size:
        raise ApiError(f"top_k must be <= {max_top_k} (--max-top-k), or 0 / >= the vocabulary ({vocab_size}) "
                       f"for none, got {body.top_k}", param="top_k")
    top_k = body.top_k if body.top_k and 0 < body.top_k < vocab_size else 0   # -1 / 0 / None / >= V: off
    return Request(list(prompt_ids), int(max_tokens), temperature=temperature, top_p=top_p, top_k=int(top_k),
                   seed=int(body.seed or 0), logprobs=logprobs)


def logprobs_of(body: CompletionBody) -> int | None:
    """The top logprobs a request asks for per token (None: no logprobs): completions' `logprobs` (an
    integer in [0, 20]), chat's `top_logprobs` (in [0, 20], default 0) with `logprobs: true`; a 400
    naming the field otherwise.

    Example:
        >>> logprobs_of(CompletionBody(logprobs=5)), logprobs_of(ChatBody(messages=[], logprobs=True))
        (5, 0)
        >>> logprobs_of(CompletionBody(logprobs=21))
        Traceback (most recent call last):
        ...
        dmtp_jax.serve.protocol.ApiError: logprobs: an integer in [0, 20], got 21
    """
    def count(value, param: str) -> int:
        if type(value) is not int or not 0 <= value <= MAX_TOP_LOGPROBS:
            raise ApiError(f"{param}: an integer in [0, {MAX_TOP_LOGPROBS}], got {str(value)[:40]}", param=param)
        return value
    if not isinstance(body, ChatBody):
        return None if body.logprobs is None else count(body.logprobs, "logprobs")
    if body.logprobs not in (None, False, True):
        raise ApiError(f"logprobs: true or false, got {str(body.logprobs)[:40]}", param="logprobs")
    top = 0 if body.top_logprobs is None else count(body.top_logprobs, "top_logprobs")
    if body.logprobs is not True:
        if top:
            raise ApiError("top_logprobs: needs logprobs: true", param="top_logprobs")
        return None
    return top
