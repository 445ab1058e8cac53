"""Tool calling on /v1/chat/completions, as OpenAI's API and vLLM's server do it.

    tool_choice "none"      the functions are rendered into the prompt; the answer is plain text
    tool_choice "auto"      the answer is parsed by the server's parser (`molora serve --enable-auto-tool-choice
                            --tool-call-parser NAME`): calls it finds become `message.tool_calls`
    "required" / a name     the answer is constrained by the grammar engine (molora.structured, the mechanism of
                            response_format) to the JSON of a call (a list of calls with parallel_tool_calls), so
                            every call parses and its arguments match the function's schema

Owns: the checks of `tools`, `tool_choice` and the tool calls and tool results of `messages` (400s naming the
field), the conversation handed to the chat template (`tools=` where the template takes them, else the default
rendering below), the schema of a required or named choice, the parser registry (`register_tool_parser`), and
turning an answer into a message or stream deltas (`ToolCalls`).

Default rendering (a chat template that does not mention `tools`): a system message lists the functions as JSON,
one a line, between <tools></tools> and asks for each call as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
(the `hermes` parser's form); an assistant message's calls are written back in that form, and tool results go
to the model as a user turn of `<tool_response>...</tool_response>` blocks.

Streaming: content streams as it comes while it cannot be the start of a call (the parser's `streamable`); from
the first possible call on, the rest of the answer is held and, when the choice ends, sent as the remaining
content and each call whole, one delta per call. Knows nothing of engines, HTTP or tokenizers' insides.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from molora.errors import MoLoRAError
from molora.server.protocol import (
    APIError,
    ChatCompletionRequest,
    ChatMessage,
    ChatMessageOut,
    Delta,
    FunctionCall,
    FunctionCallDelta,
    GenerationRequest,
    Tool,
    ToolCall,
    ToolCallDelta,
)
from molora.structured import GrammarEngineMissing, StructuredOutputError, StructuredSpec

__all__ = [
    "HermesParser",
    "JsonParser",
    "ToolCalls",
    "ToolParser",
    "auto_tool_parser",
    "check",
    "conversation",
    "register_tool_parser",
    "structured_spec",
    "tool_parser",
    "tool_parsers",
]

Call = tuple[str, dict]  # (function name, arguments)
AUTO_NEEDS_FLAGS = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}


# ------------------------------------------------------------------------------------------------ parsers


class ToolParser:
    """Finds the calls in a finished answer. `parse(text) -> (content, calls)`: content None when nothing but
    calls; text a parser cannot read stays content, with no calls. `streamable(text)`: how many leading characters
    of a partial answer are content whatever follows (a stream sends them at once): the parse of any continuation
    must begin its content with them."""

    def parse(self, text: str) -> tuple[str | None, list[Call]]:
        raise NotImplementedError

    def streamable(self, text: str) -> int:
        raise NotImplementedError


class HermesParser(ToolParser):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (Hermes, Qwen2.5, Qwen3); the last block
    may lack its closing tag (the model ended). Content is the text outside the blocks."""

    start, end = "<tool_call>", "</tool_call>"

    def parse(self, text: str) -> tuple[str | None, list[Call]]:
        first = text.find(self.start)
        if first < 0:
            return text or None, []
        calls, rest, pos = [], [], first
        while pos >= 0:
            close = text.find(self.end, pos)
            call = _call_of_json(text[pos + len(self.start) : close if close >= 0 else len(text)])
            if call is None:
                return text, []
            calls.append(call)
            if close < 0:
                break
            after = close + len(self.end)
            pos = text.find(self.start, after)
            rest.append(text[after : pos if pos >= 0 else len(text)])
        content = text[:first] + "".join(rest).strip()
        return (content if content.strip() else None), calls

    def streamable(self, text: str) -> int:
        cut = text.find(self.start)
        if cut < 0:  # hold back a tail that may be the tag's beginning
            cut = len(text)
            for k in range(min(len(self.start) - 1, len(text)), 0, -1):
                if self.start.startswith(text[-k:]):
                    cut = len(text) - k
                    break
        return cut if text[:cut].strip() else 0  # leading whitespace waits: content may turn out to be None


class JsonParser(ToolParser):
    """The whole answer is one call `{"name": ..., "arguments": {...}}` ("parameters" is read as "arguments") or a
    list of them; anything else is content."""

    def parse(self, text: str) -> tuple[str | None, list[Call]]:
        body = text.strip()
        if not body.startswith(("{", "[")):
            return text or None, []
        try:
            value = json.loads(body)
        except json.JSONDecodeError:
            return text, []
        items = value if isinstance(value, list) else [value]
        calls = [_call_of(v) for v in items]
        if not calls or any(c is None for c in calls):
            return text, []
        return None, calls  # type: ignore[return-value]

    def streamable(self, text: str) -> int:
        head = text.lstrip()
        return 0 if not head or head[0] in "{[" else len(text)


_PARSERS: dict[str, type[ToolParser]] = {"hermes": HermesParser, "json": JsonParser}


def register_tool_parser(name: str, cls: type[ToolParser]) -> None:
    """Make `cls` (a ToolParser subclass, built with no arguments) the parser `--tool-call-parser name` picks."""
    if not (isinstance(cls, type) and issubclass(cls, ToolParser)):
        raise MoLoRAError(f"tool parser {name!r}: {cls!r} is not a ToolParser subclass")
    _PARSERS[name] = cls


def tool_parsers() -> list[str]:
    return sorted(_PARSERS)


def tool_parser(name: str) -> ToolParser:
    if name not in _PARSERS:
        raise MoLoRAError(f"--tool-call-parser {name!r} is not registered; registered: {tool_parsers()}")
    return _PARSERS[name]()


def auto_tool_parser(enable: bool, name: str | None) -> str | None:
    """The parser of tool_choice "auto" on a server started with these flags (vLLM's --enable-auto-tool-choice,
    --tool-call-parser): None when auto is off; `hermes` (the default rendering's form) when no parser is named.
    MoLoRAError for a name no parser is registered under."""
    if name is not None:
        tool_parser(name)
    return (name or "hermes") if enable else None


def _call_of_json(text: str) -> Call | None:
    try:
        return _call_of(json.loads(text))
    except json.JSONDecodeError:
        return None


def _call_of(value: Any) -> Call | None:
    """(name, arguments) of a call object; None for anything else (arguments given as JSON text are read)."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    args = value.get("arguments", value.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    return (value["name"], args) if isinstance(args, dict) else None


# ------------------------------------------------------------------------------------------------ checks


@dataclass
class ToolCalls:
    """How one request's answers become messages: `mode` "auto" (a parser reads them) or "forced" (the grammar
    made them JSON calls); per choice, how much content its stream has sent."""

    mode: Literal["auto", "forced"]
    parser: ToolParser
    sent: dict[int, int] = field(default_factory=dict)

    def parse(self, text: str) -> tuple[str | None, list[Call]]:
        return self.parser.parse(text)

    def message(self, state: Any) -> ChatMessageOut:
        content, calls = self.parse(state.text)
        return ChatMessageOut(content=content, tool_calls=[_tool_call(c) for c in calls] or None)

    def finish_reason(self, state: Any) -> str | None:
        if state.finish_reason == "stop" and self.parse(state.text)[1]:
            return "tool_calls"
        return state.finish_reason

    def delta(self, state: Any, finished: bool) -> Delta:
        """The next stream delta of a choice whose text so far is `state.text`."""
        sent = self.sent.get(state.index, 0)
        if not finished:
            upto = self.parser.streamable(state.text) if self.mode == "auto" else 0
            self.sent[state.index] = max(sent, upto)
            return Delta(content=state.text[sent:upto] or None)
        content, calls = self.parse(state.text)
        deltas = [
            ToolCallDelta(
                index=i,
                id=(c := _tool_call(call)).id,
                type="function",
                function=FunctionCallDelta(name=c.function.name, arguments=c.function.arguments),
            )
            for i, call in enumerate(calls)
        ]
        return Delta(content=(content or "")[sent:] or None, tool_calls=deltas or None)


def _tool_call(call: Call) -> ToolCall:
    name, args = call
    return ToolCall(
        id="call_" + uuid.uuid4().hex,
        function=FunctionCall(name=name, arguments=json.dumps(args, ensure_ascii=False)),
    )


def check(req: ChatCompletionRequest, info: Any) -> ToolCalls | None:
    """400 (naming the field) for a bad tool, tool choice or tool message; the request's `ToolCalls`, or None when
    its answer is plain text (no tools, or tool_choice "none"). info: the served bundle's ModelInfo."""
    _check_messages(req.messages)
    tools = req.tools or []
    if not tools:
        if req.tool_choice is not None:
            raise APIError(400, "tool_choice is only allowed when tools are given", param="tool_choice")
        return None
    names = [t.function.name for t in tools]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise APIError(400, f"tools name functions {twice} more than once; give each its own name", param="tools")
    for i, tool in enumerate(tools):
        params = tool.function.parameters
        if params is not None and params.get("type", "object") != "object":
            raise APIError(
                400,
                f"function {tool.function.name!r}: parameters must be the JSON schema of an object "
                f'(type "object"), not type {params.get("type")!r}',
                param=f"tools[{i}].function.parameters",
            )
    choice = req.tool_choice if req.tool_choice is not None else "auto"
    if choice == "none":
        return None
    if choice == "auto":
        if info.tool_parser is None:
            raise APIError(400, AUTO_NEEDS_FLAGS, param="tool_choice")
        return ToolCalls("auto", tool_parser(info.tool_parser))
    if not isinstance(choice, str) and choice.function.name not in names:
        raise APIError(
            400,
            f"tool_choice names function {choice.function.name!r}, which tools do not hold; tools: {names}",
            param="tool_choice.function.name",
        )
    return ToolCalls("forced", JsonParser())


def _check_messages(messages: list[ChatMessage]) -> None:
    ids: set[str] = set()
    for i, m in enumerate(messages):
        if m.tool_calls is not None and m.role != "assistant":
            raise APIError(
                400, f"a {m.role} message has tool_calls; only assistant messages do", param=f"messages[{i}].tool_calls"
            )
        if m.tool_call_id is not None and m.role != "tool":
            raise APIError(
                400, f"a {m.role} message has tool_call_id; only tool messages do", param=f"messages[{i}].tool_call_id"
            )
        for j, call in enumerate(m.tool_calls or []):
            if not isinstance(_arguments(call.function.arguments), dict):
                raise APIError(
                    400,
                    f"tool call {call.id!r}: arguments must be a JSON object as text, "
                    f"got {call.function.arguments[:80]!r}",
                    param=f"messages[{i}].tool_calls[{j}].function.arguments",
                )
            ids.add(call.id)
        if m.role == "tool":
            if m.tool_call_id is None:
                raise APIError(400, "a tool message needs tool_call_id", param=f"messages[{i}].tool_call_id")
            if m.tool_call_id not in ids:
                raise APIError(
                    400,
                    f"tool_call_id {m.tool_call_id!r} matches no tool call of an earlier assistant message "
                    f"(calls so far: {sorted(ids)[:8]})",
                    param=f"messages[{i}].tool_call_id",
                )


def _arguments(text: str) -> Any:
    if not text.strip():
        return {}  # an empty string: no arguments (some clients send it for a function without parameters)
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


# ------------------------------------------------------------------------------------------------ grammar


def structured_spec(req: GenerationRequest) -> tuple[StructuredSpec, str] | None:
    """What the answer must match and the parameter that asked: a required or named tool choice's schema, or
    the request's response_format / structured_outputs / guided_* (GenerationRequest.structured_spec); 400 when
    both ask."""
    asked = req.structured_spec()
    choice = getattr(req, "tool_choice", None)
    if not getattr(req, "tools", None) or choice in (None, "none", "auto"):
        return asked
    if asked is not None:
        raise APIError(
            400,
            f"tool_choice {choice if isinstance(choice, str) else 'naming a function'} constrains the answer to "
            f"tool calls; it cannot also follow {asked[1]}. Send one of them",
            param=asked[1],
        )
    tools: list[Tool] = req.tools  # type: ignore[attr-defined]
    if isinstance(choice, str):  # "required"
        picked = list(range(len(tools)))
    else:
        picked = [next(i for i, t in enumerate(tools) if t.function.name == choice.function.name)]
    one = [_call_schema(tools[i], i) for i in picked]
    schema: dict = one[0] if len(one) == 1 else {"anyOf": one}
    if choice == "required" and req.parallel_tool_calls:  # type: ignore[attr-defined]
        schema = {"type": "array", "items": schema, "minItems": 1}
    defs = {k: v for i in picked for k, v in _defs(tools[i], i).items()}
    if defs:
        schema = {**schema, "$defs": defs}
    strict = any(tools[i].function.strict for i in picked)
    param = f"tools[{picked[0]}].function.parameters" if len(picked) == 1 else "tools"
    try:
        return StructuredSpec.json_schema(schema, strict), param
    except StructuredOutputError as e:
        raise APIError(400, str(e), param=param) from e


def blame(req: GenerationRequest, param: str, compile: Any) -> str:
    """The parameter to name for a tool choice's schema that did not compile: the first tool whose own call schema
    does not compile (`compile(spec)` raises StructuredOutputError), else `param`."""
    if param != "tools":
        return param
    for i, tool in enumerate(req.tools or []):  # type: ignore[attr-defined]
        schema = {**_call_schema(tool, i), **({"$defs": d} if (d := _defs(tool, i)) else {})}
        try:
            compile(StructuredSpec.json_schema(schema))
        except GrammarEngineMissing:
            return param
        except StructuredOutputError:
            return f"tools[{i}].function.parameters"
    return param


def _call_schema(tool: Tool, i: int) -> dict:
    """The JSON of one call of `tool`; its parameters' local definitions move to the root's $defs as `t<i>.NAME`
    (a schema's "#/$defs/..." pointers are relative to the document it is part of)."""
    params = tool.function.parameters
    if params is None:
        params = NO_ARGUMENTS
    params = _move_refs({k: v for k, v in params.items() if k not in ("$defs", "definitions")}, i)
    return {
        "type": "object",
        "properties": {"name": {"const": tool.function.name}, "arguments": params},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _defs(tool: Tool, i: int) -> dict:
    params = tool.function.parameters or {}
    out = {}
    for key in ("$defs", "definitions"):
        for name, sub in (params.get(key) or {}).items():
            out[f"t{i}.{name}"] = _move_refs(sub, i)
    return out


def _move_refs(schema: Any, i: int) -> Any:
    if isinstance(schema, list):
        return [_move_refs(v, i) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for k, v in schema.items():
        if k == "$ref" and isinstance(v, str):
            for key in ("$defs", "definitions"):
                if v.startswith(f"#/{key}/"):
                    v = f"#/$defs/t{i}.{v[len(key) + 3 :]}"
            out[k] = v
        elif k in ("enum", "const", "default", "examples"):
            out[k] = v  # values, not schemas
        else:
            out[k] = _move_refs(v, i)
    return out


# ------------------------------------------------------------------------------------------------ rendering

PREAMBLE = (
    "# Tools\n\nYou can call these functions; each line between <tools></tools> is one, as JSON:\n"
    "<tools>\n{tools}\n</tools>\n\n"
    "To call a function, answer with one block per call, its name and its arguments as a JSON object:\n"
    '<tool_call>\n{{"name": "<function name>", "arguments": {{<arguments>}}}}\n</tool_call>'
)


def conversation(req: ChatCompletionRequest, tokenizer: Any) -> tuple[list[dict], dict]:
    """(messages, extra keyword arguments) for `tokenizer.apply_chat_template`: with tools and a template that takes
    them, the messages as OpenAI's (calls' arguments as objects, as templates expect) and `tools=`; with a template
    that does not, the default rendering (module docstring); without any tool, role and text only."""
    tools = [t.model_dump(exclude_none=True) for t in req.tools or []]
    has_calls = any(m.role == "tool" or m.tool_calls for m in req.messages)
    if not tools and not has_calls:
        return [{"role": _role(m), "content": m.text()} for m in req.messages], {}
    if "tools" in str(getattr(tokenizer, "chat_template", "") or ""):
        return [_message(m) for m in req.messages], ({"tools": tools} if tools else {})
    return _default_rendering(req.messages, tools), {}


def _role(m: ChatMessage) -> str:
    return "system" if m.role == "developer" else m.role


def _message(m: ChatMessage) -> dict:
    out: dict[str, Any] = {"role": _role(m), "content": m.text()}
    if m.tool_calls:
        out["tool_calls"] = [
            {
                "id": c.id,
                "type": "function",
                "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)},
            }
            for c in m.tool_calls
        ]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.name is not None:
        out["name"] = m.name
    return out


def _default_rendering(messages: list[ChatMessage], tools: list[dict]) -> list[dict]:
    out: list[dict] = []
    for m in messages:
        if m.role == "tool":
            block = f"<tool_response>\n{m.text()}\n</tool_response>"
            if out and out[-1].get("tool_results"):  # consecutive results: one user turn
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "tool_results": True})
            continue
        text = m.text()
        if m.tool_calls:
            blocks = [
                "<tool_call>\n"
                + json.dumps(
                    {"name": c.function.name, "arguments": _arguments(c.function.arguments)}, ensure_ascii=False
                )
                + "\n</tool_call>"
                for c in m.tool_calls
            ]
            text = "\n".join(([text] if text else []) + blocks)
        out.append({"role": _role(m), "content": text})
    for turn in out:
        turn.pop("tool_results", None)
    if tools:
        listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        preamble = PREAMBLE.format(tools=listing)
        if out and out[0]["role"] == "system":
            out[0]["content"] = out[0]["content"] + "\n\n" + preamble
        else:
            out.insert(0, {"role": "system", "content": preamble})
    return out
