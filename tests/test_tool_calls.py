"""Chat tools and reasoning (issue 68, item 4, text level): the output parser (`serve/tool_calls.py`),
the demo's ChatML template with tools and tool responses, and the HTTP path through the real openai
client (the tiny random model writes no tool calls: a scripted decode stands in for its text)."""

import json
import os

import pytest

from dmtp_jax.serve.tool_calls import OutputParser, parse_output
from tests.serve_fixtures import MAX_MODEL_LEN, chat_tokenizer, serve_decoder

CALL = '<tool_call>\n{"name": "%s", "arguments": {"city": "%s"}}\n</tool_call>'
OUTPUT = ("<think>\nThe user wants weather.\n</think>\n\nLet me check. " + CALL % ("get_weather", "Paris") + "\n"
          + CALL % ("get_weather", "Oslo") + "\n<tool_call>not json</tool_call> " + CALL % ("launch", "x"))
DEMO_TARGET = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "demo", "target")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


def streamed(text: str, names: set, think: bool, size: int) -> tuple[dict, list]:
    """The parser's deltas over `text` in chunks of `size` characters, joined."""
    parser, joined, calls = OutputParser(names, think), {}, []
    deltas = [parser.add(text[i:i + size]) for i in range(0, len(text), size)] + [parser.flush()]
    for d in deltas:
        calls += d.pop("tool_calls", [])
        for k, v in d.items():
            joined[k] = joined.get(k, "") + v
    return joined, calls


def test_parser_splits_reasoning_content_and_calls():
    parts, calls = parse_output(OUTPUT, {"get_weather"}, think=True)
    assert parts["reasoning_content"] == "The user wants weather."
    # the unparsable block and the unknown function stay in the content, verbatim
    assert parts["content"] == ("Let me check. \n\n<tool_call>not json</tool_call> " + CALL % ("launch", "x"))
    assert [c["function"] for c in calls] == [{"name": "get_weather", "arguments": '{"city": "Paris"}'},
                                              {"name": "get_weather", "arguments": '{"city": "Oslo"}'}]
    assert all(c["type"] == "function" and c["id"].startswith("call_") and len(c["id"]) == 37 for c in calls)
    assert len({c["id"] for c in calls}) == 2
    only, calls = parse_output("\n" + CALL % ("get_weather", "Rome") + "\n", {"get_weather"}, think=True)
    assert only == {} and len(calls) == 1             # whitespace around the calls is no content
    assert parse_output("<think>a</think>b", set(), think=False) == ({"content": "<think>a</think>b"}, [])
    assert parse_output(" <think>\nx", set(), think=True) == ({"reasoning_content": "x"}, [])   # cut by max_tokens


@pytest.mark.parametrize("size", [1, 2, 3, 7, 11])
def test_streaming_across_chunk_boundaries_equals_the_whole(size):
    whole, calls = parse_output(OUTPUT, {"get_weather"}, think=True)
    parts, streamed_calls = streamed(OUTPUT, {"get_weather"}, True, size)
    assert parts == whole
    assert [c["index"] for c in streamed_calls] == [0, 1]
    assert [c["function"] for c in streamed_calls] == [c["function"] for c in calls]
    text = "no tags <tool but <thin and </tool_call> here"
    assert streamed(text, {"get_weather"}, True, size) == ({"content": text}, [])


def test_demo_template_renders_tools_and_tool_responses():
    """The demo's ChatML template, rendered by transformers and by the plain tokenizer alike."""
    from transformers import AutoTokenizer

    from dmtp_jax.tokenizer import load_tokenizer
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "", "reasoning_content": "Use the tool.",
                 "tool_calls": [{"id": "call_1", "type": "function",
                                 "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}]
    hf = AutoTokenizer.from_pretrained(DEMO_TARGET)
    text = hf.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    want = ("<|im_start|>system\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
            + json.dumps(TOOLS[0]) + "\n</tools>\n\nFor each function call, return a json object with function "
            "name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": "
            "<function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n"
            "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
            "<|im_start|>assistant\n<think>\nUse the tool.\n</think>\n\n" + CALL % ("get_weather", "Paris")
            + "<|im_end|>\n<|im_start|>user\n<tool_response>\n18 C\n</tool_response><|im_end|>\n"
            "<|im_start|>assistant\n")
    assert text == want
    plain = load_tokenizer(DEMO_TARGET, plain=True)
    assert type(plain).__name__ == "PlainTokenizer"            # still no transformers import for the demo
    assert plain.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=False) == want
    ids = hf.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=True)
    assert plain.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True) == list(
        ids["input_ids"] if hasattr(ids, "keys") else ids)


class ScriptedTokenizer:
    """A tokenizer whose decode of n output tokens is `script[:4 n]` while `script` is set."""

    def __init__(self, tok, prompt_len: dict):
        self.tok, self.script, self.prompt_len = tok, None, prompt_len

    def __getattr__(self, name):
        return getattr(self.tok, name)

    def decode(self, ids, **kw):
        return self.script[:4 * len(ids)] if self.script is not None else self.tok.decode(ids, **kw)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """`(openai client, tokenizer)` of a server on the tiny decoder whose chat template offers tools
    (compactly: the byte-level prompt fits the tiny model) and writes think tags."""
    import openai

    from dmtp_jax.serve.app import Scheduler, build_app, serving_in_thread
    from dmtp_jax.serve.engine import Engine
    tok, _ = chat_tokenizer(str(tmp_path_factory.mktemp("tok")), [{"role": "user", "content": "hi"}])
    tok.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
                         "{% if tools %}[{{ tools | map(attribute='function.name') | join(',') }}]{% endif %}"
                         "<assistant>{# writes <think> tags #}")
    scripted = ScriptedTokenizer(tok, {})
    engine = Engine(serve_decoder(), max_batch_size=4, max_model_len=MAX_MODEL_LEN, stop_ids=[], buckets=(4,))
    with serving_in_thread(build_app(Scheduler(engine), scripted, "tiny", drain_s=5)) as base:
        yield openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0), scripted


def test_tools_through_the_openai_client(served):
    client, tok = served
    messages = [{"role": "user", "content": "hi"}]
    ids = tok.tok.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    plain = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
    out = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0, tools=TOOLS)
    assert out.usage.prompt_tokens == len(ids) > plain.usage.prompt_tokens      # the tools are in the prompt
    assert out.choices[0].message.content == tok.tok.decode(
        serve_decoder().generate([ids], 8, stop_ids=[]).output_ids[0], skip_special_tokens=True)
    assert out.choices[0].finish_reason == "length" and not out.choices[0].message.tool_calls
    none = client.chat.completions.create(model="tiny", messages=messages, max_tokens=2, tools=TOOLS,
                                          tool_choice="none")
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens              # "none": tools not offered

    tok.script = OUTPUT
    try:
        steps = -(-len(OUTPUT) // 4)
        out = client.chat.completions.create(model="tiny", messages=messages, max_tokens=steps, temperature=0,
                                             tools=TOOLS)
        stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=steps, temperature=0,
                                                tools=TOOLS, stream=True)
        chunks = list(stream)
    finally:
        tok.script = None
    msg, want = out.choices[0].message, parse_output(OUTPUT, {"get_weather"}, True)[0]
    assert msg.content == want["content"] and msg.model_extra["reasoning_content"] == want["reasoning_content"]
    assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls] == [
        ("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Oslo"})]
    assert out.choices[0].finish_reason == "length"       # max_tokens ended it; a stop would be "tool_calls"
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas) == want["content"]
    assert "".join((d.model_extra or {}).get("reasoning_content", "") for d in deltas) == want["reasoning_content"]
    calls = [t for d in deltas for t in d.tool_calls or []]
    assert [(t.index, t.function.name) for t in calls] == [(0, "get_weather"), (1, "get_weather")]


def test_unsupported_tool_choice_and_malformed_tools_are_400s(served):
    import openai
    client, _ = served
    messages = [{"role": "user", "content": "hi"}]
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, tool_choice=choice)
        assert e.value.body["param"] == "tool_choice" and "constrained decoding" in e.value.body["message"]
    for tools in ([{"type": "function"}], [{"type": "function", "function": {"name": 3}}], {"a": 1}):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="tiny", messages=messages, tools=tools)
        assert e.value.body["param"] == "tools"


def test_finish_reason_is_tool_calls_when_the_output_stopped_after_calls():
    from dmtp_jax.serve.choices import Choice
    from dmtp_jax.serve.request import Request
    req = Request([1], 4)
    req.finish_reason = "stop"
    choice = Choice(0, req, str, [], str, True, ({"get_weather"}, False))
    message = choice.message(CALL % ("get_weather", "Rome"))
    assert message["content"] is None and len(message["tool_calls"]) == 1 and choice.finish_reason() == "tool_calls"
    plain = Choice(0, req, str, [], str, True, (set(), False))
    assert plain.message("x") == {"role": "assistant", "content": "x"} and plain.finish_reason() == "stop"
