"""Tool calling on /v1/chat/completions: tools and tool_choice in, message.tool_calls and stream deltas out.

A tiny random Qwen3 model with the character-level tokenizer that can spell JSON (tests/structured_fixtures.py),
given a compact Qwen3-style chat template that takes `tools`. Every randomness is a seeded generator. The invariants:
with tool_choice required or named every call parses and its arguments validate against the function's schema
(the grammar engine enforces them); "auto" is parsed by the server's parser and refused without it; text that is no
call stays content; a stream sends each call whole with OpenAI's delta shape; every bad input is a 400 naming its
field.
"""

from __future__ import annotations

import json
import sys

import httpx
import jsonschema
import pytest

import molora
from molora.engine import Engine, EngineConfig
from molora.errors import MoLoRAError
from molora.routing import VocabRouter
from molora.server import ServerThread, create_app
from molora.server import tools as tool_calls
from molora.server.protocol import ChatCompletionRequest
from molora.structured import INSTALL_HINT
from tests.conftest import make_peft_adapter, random_model, tiny_config
from tests.structured_fixtures import char_tokenizer

ARCH = "qwen3"
CFG = EngineConfig(max_num_seqs=8, max_model_len=2048, kv_budget_tokens=16384)

# a compact Qwen3-style template: tools listed in the system turn, calls as <tool_call> blocks, results as a user turn
TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system {% if messages[0].role == 'system' %}{{ messages[0].content }} {% endif %}"
    "<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools><|im_end|>"
    "{%- elif messages[0].role == 'system' %}<|im_start|>system {{ messages[0].content }}<|im_end|>{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'system' and loop.first %}"
    "{%- elif m.role == 'assistant' %}<|im_start|>assistant {{ m.content }}"
    '{%- for c in m.tool_calls or [] %}<tool_call>{"name": "{{ c.function.name }}", '
    '"arguments": {{ c.function.arguments | tojson }}}</tool_call>{% endfor %}<|im_end|>'
    "{%- elif m.role == 'tool' %}<|im_start|>user <tool_response>{{ m.content }}</tool_response><|im_end|>"
    "{%- else %}<|im_start|>{{ m.role }} {{ m.content }}<|im_end|>{% endif %}"
    "{%- endfor %}{% if add_generation_prompt %}<|im_start|>assistant {% endif %}"
)

# functions whose every call is short (enums, bounded strings and ranges): a random model must end them
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "the weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 6}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
LIGHTS = {
    "type": "function",
    "function": {
        "name": "set_lights",
        "parameters": {
            "type": "object",
            "properties": {"on": {"type": "boolean"}, "level": {"type": "integer", "minimum": 0, "maximum": 9}},
            "required": ["on", "level"],
            "additionalProperties": False,
        },
    },
}
PING = {"type": "function", "function": {"name": "ping"}}  # no parameters: the arguments are {}
# local definitions, as pydantic writes them: "#/$defs/..." pointers inside the function's own schema
MOVE = {
    "type": "function",
    "function": {
        "name": "move",
        "parameters": {
            "$defs": {"Dir": {"enum": ["n", "s", "e", "w"]}},
            "type": "object",
            "properties": {"to": {"$ref": "#/$defs/Dir"}},
            "required": ["to"],
            "additionalProperties": False,
        },
    },
}
SCHEMAS = {t["function"]["name"]: t["function"].get("parameters") for t in (WEATHER, LIGHTS, PING, MOVE)}
USER = [{"role": "user", "content": "weather in Oslo?"}]


@pytest.fixture(scope="module")
def tok():
    t = char_tokenizer()
    t.chat_template = TOOLS_TEMPLATE
    return t


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {n: make_peft_adapter(root / n, ARCH, seed=i) for i, n in enumerate(("a", "b"))}


def _engine(paths, tok):
    config = tiny_config(ARCH)
    config.max_position_embeddings = 2048  # a char-level prompt listing tools runs to several hundred ids
    mm = molora.attach(
        random_model(config, seed=0),
        paths,
        router=VocabRouter([(0, 64, "a")], default="b"),
        tokenizer=tok,
        check_base=False,
    )
    return Engine(mm, CFG)


@pytest.fixture(scope="module")
def server(paths, tok):
    app = create_app(_engine(paths, tok), model_name="tiny", enable_auto_tool_choice=True, tool_call_parser="hermes")
    with ServerThread(app) as url, httpx.Client(base_url=url, timeout=120) as http:
        yield http


def _chat(**extra):
    return {"model": "tiny", "messages": USER, "max_tokens": 300, **extra}


def _calls_valid(message: dict) -> list[dict]:
    """The message's calls, each checked: an id call_<hex>, a known function, arguments that parse and validate."""
    calls = message["tool_calls"]
    assert calls, message
    for c in calls:
        assert c["id"].startswith("call_") and c["type"] == "function"
        args = json.loads(c["function"]["arguments"])
        schema = SCHEMAS[c["function"]["name"]]
        jsonschema.validate(args, schema if schema is not None else {"type": "object", "maxProperties": 0})
    return calls


# ------------------------------------------------------------------------------------------ parsers


def test_hermes_parser_reads_blocks_and_keeps_the_rest_as_content():
    p = tool_calls.HermesParser()
    text = 'Let me look.<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call><tool_call>{"name": "g"}</tool_call>'
    assert p.parse(text) == ("Let me look.", [("f", {"x": 1}), ("g", {})])
    assert p.parse('<tool_call>{"name": "f", "arguments": "{\\"x\\": 2}"}') == (None, [("f", {"x": 2})])  # unclosed
    assert p.parse("no calls here") == ("no calls here", [])
    broken = 'ok <tool_call>{"name": "f", "arguments": {"x": </tool_call>'
    assert p.parse(broken) == (broken, [])  # unparseable: all of it stays content
    assert p.parse('<tool_call>{"arguments": {}}</tool_call>')[1] == []  # no name: not a call
    # streaming: text before a possible tag goes out; a partial tag and leading whitespace wait
    assert p.streamable("Hello <tool") == len("Hello ")
    assert p.streamable("Hello <tool_call>{") == len("Hello ")
    assert p.streamable("  ") == 0 and p.streamable("Hi") == 2


def test_json_parser_reads_one_call_or_a_list():
    p = tool_calls.JsonParser()
    assert p.parse('{"name": "f", "arguments": {"a": "b"}}') == (None, [("f", {"a": "b"})])
    assert p.parse(' [{"name": "f", "parameters": {}}, {"name": "g", "arguments": {}}]') == (
        None,
        [("f", {}), ("g", {})],
    )
    assert p.parse('{"answer": 42}') == ('{"answer": 42}', [])
    assert p.parse("plain text") == ("plain text", [])
    assert p.streamable("plain") == 5 and p.streamable(" {") == 0


def test_a_registered_parser_is_picked_by_name():
    class Upper(tool_calls.ToolParser):
        def parse(self, text):
            return None, [(text.strip().lower(), {})]

        def streamable(self, text):
            return 0

    tool_calls.register_tool_parser("upper-test", Upper)
    assert "upper-test" in tool_calls.tool_parsers()
    assert tool_calls.tool_parser("upper-test").parse("PING") == (None, [("ping", {})])
    assert tool_calls.auto_tool_parser(True, None) == "hermes" and tool_calls.auto_tool_parser(False, "json") is None
    with pytest.raises(MoLoRAError, match="registered"):
        tool_calls.auto_tool_parser(True, "nope")
    with pytest.raises(MoLoRAError, match="ToolParser"):
        tool_calls.register_tool_parser("bad", dict)


# ------------------------------------------------------------------------------------------ rendering


def _req(**body) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": USER, **body})


HISTORY = [
    {"role": "user", "content": "weather in Oslo?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "12 C"},
]


def test_a_template_that_takes_tools_gets_them_and_the_calls_as_objects(tok):
    conv, extra = tool_calls.conversation(_req(messages=HISTORY, tools=[WEATHER]), tok)
    assert extra["tools"][0]["function"]["name"] == "get_weather"
    assert conv[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    assert conv[2] == {"role": "tool", "content": "12 C", "tool_call_id": "call_1"}
    text = tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=False, **extra)
    assert '"name": "get_weather"' in text and "<tool_response>12 C</tool_response>" in text
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>' in text
    # without any tool the conversation is role and text, as before
    assert tool_calls.conversation(_req(), tok) == ([{"role": "user", "content": "weather in Oslo?"}], {})


def test_a_template_without_tools_gets_the_default_rendering():
    plain = char_tokenizer()  # its template knows nothing of tools
    body = {"messages": [{"role": "system", "content": "Be brief."}, *HISTORY], "tools": [WEATHER, PING]}
    conv, extra = tool_calls.conversation(_req(**body), plain)
    assert extra == {} and [m["role"] for m in conv] == ["system", "user", "assistant", "user"]
    assert conv[0]["content"].startswith("Be brief.\n\n# Tools") and '"name": "ping"' in conv[0]["content"]
    assert "<tool_call>" in conv[0]["content"]  # the form the hermes parser reads
    assert conv[2]["content"] == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    assert conv[3]["content"] == "<tool_response>\n12 C\n</tool_response>"
    conv, _ = tool_calls.conversation(_req(tools=[WEATHER]), plain)
    assert conv[0]["role"] == "system" and conv[1] == USER[0]


# ------------------------------------------------------------------------------------------ the server


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_required_and_named_calls_always_parse_and_validate(server, seed):
    tools = [WEATHER, LIGHTS, PING, MOVE]
    for choice in ["required", {"type": "function", "function": {"name": "set_lights"}}]:
        for parallel in (True, False):
            body = _chat(tools=tools, tool_choice=choice, parallel_tool_calls=parallel, n=3, seed=seed)
            r = server.post("/chat/completions", json={**body, "temperature": 1.0})
            assert r.status_code == 200, r.text
            for c in r.json()["choices"]:
                assert c["finish_reason"] == "tool_calls" and c["message"]["content"] is None, c
                calls = _calls_valid(c["message"])
                if isinstance(choice, dict):
                    assert [x["function"]["name"] for x in calls] == ["set_lights"]
                if not parallel or isinstance(choice, dict):
                    assert len(calls) == 1
    r = server.post("/chat/completions", json=_chat(tools=[MOVE], tool_choice="required", temperature=0.0))
    (call,) = _calls_valid(r.json()["choices"][0]["message"])
    assert call["function"]["name"] == "move"


def test_a_named_call_streams_as_one_tool_call_delta(server):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    body = _chat(tools=[WEATHER, LIGHTS], tool_choice=choice, stream=True, temperature=0.7, seed=5)
    with server.stream("POST", "/chat/completions", json=body) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    deltas = [e["choices"][0]["delta"] for e in events]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert not any(d.get("content") for d in deltas[1:])  # the JSON of a forced call is never content
    pieces = [tc for d in deltas for tc in d.get("tool_calls") or []]
    assert len(pieces) == 1 and set(pieces[0]) == {"index", "id", "type", "function"} and pieces[0]["index"] == 0
    assert pieces[0]["function"]["name"] == "get_weather" and pieces[0]["id"].startswith("call_")
    jsonschema.validate(json.loads(pieces[0]["function"]["arguments"]), SCHEMAS["get_weather"])
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"


FORCED_ANSWER = 'Checking.<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}</tool_call>'


def test_auto_parses_a_hermes_answer_and_plain_text_stays_content(server):
    """The model's answer is forced (guided_choice) so that the parser has something to read."""
    r = server.post("/chat/completions", json=_chat(tools=[WEATHER], guided_choice=[FORCED_ANSWER]))
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Checking."
    (call,) = _calls_valid(choice["message"])
    assert json.loads(call["function"]["arguments"]) == {"city": "Oslo", "unit": "c"}
    r = server.post("/chat/completions", json=_chat(tools=[WEATHER], tool_choice="auto", guided_choice=["Sunny."]))
    choice = r.json()["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "Sunny."} and choice["finish_reason"] == "stop"
    # "none": the tools are in the prompt, the answer is never parsed
    r = server.post("/chat/completions", json=_chat(tools=[WEATHER], tool_choice="none", guided_choice=[FORCED_ANSWER]))
    choice = r.json()["choices"][0]
    assert choice["message"]["content"] == FORCED_ANSWER and "tool_calls" not in choice["message"]
    assert choice["finish_reason"] == "stop"


def test_auto_streams_content_first_then_each_call(server):
    body = _chat(tools=[WEATHER], guided_choice=[FORCED_ANSWER], stream=True, n=2)
    with server.stream("POST", "/chat/completions", json=body) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    for index in (0, 1):
        mine = [e["choices"][0] for e in events if e["choices"][0]["index"] == index]
        content = "".join(c["delta"].get("content") or "" for c in mine)
        calls = [tc for c in mine for tc in c["delta"].get("tool_calls") or []]
        assert content == "Checking." and len(calls) == 1 and calls[0]["function"]["name"] == "get_weather"
        first_call = next(i for i, c in enumerate(mine) if c["delta"].get("tool_calls"))
        assert "".join(c["delta"].get("content") or "" for c in mine[:first_call]) == "Checking."
        assert mine[-1]["finish_reason"] == "tool_calls"


def test_a_conversation_with_tool_results_is_served(server):
    r = server.post("/chat/completions", json=_chat(messages=HISTORY, tools=[WEATHER], guided_choice=["It is 12 C."]))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "It is 12 C."


@pytest.mark.parametrize(
    "body, param, words",
    [
        ({"tool_choice": "required"}, "tool_choice", "only allowed when tools"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice.function.name",
            "tools do not hold",
        ),
        (
            {"messages": [USER[0], {"role": "tool", "tool_call_id": "call_9", "content": "x"}]},
            "messages[1].tool_call_id",
            "matches no tool call",
        ),
        ({"messages": [USER[0], {"role": "tool", "content": "x"}]}, "messages[1].tool_call_id", "needs tool_call_id"),
        (
            {
                "messages": [
                    {
                        **HISTORY[1],
                        "tool_calls": [{**HISTORY[1]["tool_calls"][0], "function": {"name": "f", "arguments": "{"}}],
                    }
                ]
            },
            "messages[0].tool_calls[0].function.arguments",
            "JSON object",
        ),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {"type": "object", "properties": {"a": {"type": "nope"}}},
                        },
                    }
                ],
                "tool_choice": "required",
            },
            "tools[0].function.parameters",
            "invalid",
        ),
        (
            {
                "tools": [
                    WEATHER,
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}},
                        },
                    },
                ],
                "tool_choice": "required",
            },
            "tools[1].function.parameters",
            "cannot be compiled",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
            "tools[0].function.parameters",
            'type "object"',
        ),
        ({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, "tools", "more than once"),
        (
            {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
            "response_format",
            "cannot also follow",
        ),
        ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools.0.function.name", "pattern"),
    ],
)
def test_bad_tool_input_gets_a_400_naming_the_field(server, body, param, words):
    r = server.post("/chat/completions", json=_chat(max_tokens=5, **body))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err


def test_auto_needs_the_servers_flag(paths, tok, monkeypatch):
    app = create_app(_engine(paths, tok), model_name="tiny")  # no --enable-auto-tool-choice
    with ServerThread(app) as url, httpx.Client(base_url=url, timeout=120) as http:
        with monkeypatch.context() as m:  # without the grammar engine a constrained choice names the install
            m.setitem(sys.modules, "xgrammar", None)
            named = {"type": "function", "function": {"name": "get_weather"}}
            r = http.post("/chat/completions", json=_chat(tools=[WEATHER], tool_choice=named))
            assert r.status_code == 400 and INSTALL_HINT in r.json()["error"]["message"], r.text
        for extra in ({}, {"tool_choice": "auto"}):  # tools without tool_choice mean "auto", as OpenAI's
            r = http.post("/chat/completions", json=_chat(tools=[WEATHER], **extra))
            assert r.status_code == 400 and "--enable-auto-tool-choice" in r.json()["error"]["message"]
            assert r.json()["error"]["param"] == "tool_choice"
        named = {"type": "function", "function": {"name": "get_weather"}}
        r = http.post("/chat/completions", json=_chat(tools=[WEATHER], tool_choice=named))
        assert r.status_code == 200 and _calls_valid(r.json()["choices"][0]["message"])
        r = http.post("/chat/completions", json=_chat(tools=[WEATHER], tool_choice="none", max_tokens=5))
        assert r.status_code == 200 and "tool_calls" not in r.json()["choices"][0]["message"]


def test_the_openai_client_round_trip(server):
    """The openai SDK against the live server: a named call, then the call and its result sent back, streamed."""
    import openai

    client = openai.OpenAI(base_url=str(server.base_url).rstrip("/"), api_key="x", max_retries=0)
    r = client.chat.completions.create(
        model="tiny",
        messages=USER,
        tools=[WEATHER, LIGHTS],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=300,
        seed=3,
    )
    call = r.choices[0].message.tool_calls[0]
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS["get_weather"])
    history = [
        *USER,
        r.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "12 C"},
    ]
    stream = client.chat.completions.create(
        model="tiny",
        messages=history,
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=300,
        stream=True,
    )
    chunks = list(stream)
    (piece,) = [tc for c in chunks for tc in c.choices[0].delta.tool_calls or []]
    assert piece.function.name == "get_weather" and chunks[-1].choices[0].finish_reason == "tool_calls"


def test_serve_flags_reach_the_server(monkeypatch):
    import molora.server
    from molora.cli import build_parser
    from molora.cli.serve import _serve

    seen = {}
    monkeypatch.setattr(molora.server, "serve", lambda bundle, **kw: seen.update(kw))
    args = build_parser().parse_args(["serve", "--enable-auto-tool-choice", "--tool-call-parser", "json"])
    assert _serve(args) == 0
    assert seen["enable_auto_tool_choice"] is True and seen["tool_call_parser"] == "json"
    args = build_parser().parse_args(["serve"])
    _serve(args)
    assert seen["enable_auto_tool_choice"] is False and seen["tool_call_parser"] is None
    with pytest.raises(MoLoRAError, match="--enable-auto-tool-choice"):
        _serve(build_parser().parse_args(["serve", "--ray", "--enable-auto-tool-choice"]))
