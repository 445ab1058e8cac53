"""The wire format of the OpenAI-compatible API: request and response models and the error JSON.

Owns: what a request body may hold (types, ranges, which OpenAI parameters molora refuses and why), the
shape of every response and stream chunk, and `APIError` (an HTTP status plus OpenAI's error object
`{"error": {"message", "type", "param", "code"}}`). Knows nothing of engines, tokenizers or FastAPI.

Models are strict (no "1" for 1) and refuse unknown fields, as OpenAI's API does; NaN and infinity are
refused everywhere.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError, ValidationInfo, field_validator

from molora.structured import StructuredOutputError, StructuredSpec

MAX_N = 16  # choices per request (each one is an engine request)
MAX_STOP = 4  # stop strings, as OpenAI
MAX_BATCH = 64  # prompts in one /v1/completions call
MAX_LOGPROBS = 20  # top-n logprobs (SamplingParams' limit)
MAX_STOP_IDS = 64  # vLLM's stop_token_ids per request
TemplateKey = Annotated[str, StringConstraints(pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")]
JSONScalar = str | int | float | bool | None
# apply_chat_template's own arguments and the variables the server renders: a client may not replace them
RESERVED_TEMPLATE_KEYS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "chat_template",
        "return_dict",
        "return_tensors",
        "tokenizer_kwargs",
        "padding",
        "truncation",
        "max_length",
        "bos_token",
        "eos_token",
        "tool_call_parser",
    }
)
MAX_LOGIT_BIAS = 1024  # logit_bias entries per request
MAX_BAD_WORDS = 256  # bad_words per request (each is tokenized and matched every step)
INT64 = 2**63


# ----------------------------------------------------------------------------------------------- errors


class APIError(Exception):
    """An error the client caused (4xx) or must wait out (429/503), rendered as OpenAI's error object."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def validation_error(e: ValidationError) -> APIError:
    """A 400 naming the first offending field, its problem and, for unknown fields, that they are refused."""
    err = e.errors(include_url=False)[0]
    loc = [str(p) for p in err["loc"] if not _is_union_tag(p)]
    param = ".".join(loc) or None
    if err["type"] == "extra_forbidden":
        msg = f"unrecognized request argument {param!r}: molora does not support it"
    else:
        got = repr(err.get("input"))
        msg = f"{param or 'body'}: {err['msg']} (got {got[:80] + '...' if len(got) > 80 else got})"
    return APIError(400, msg, param=param, code="invalid_value")


def _is_union_tag(part: str | int) -> bool:
    """pydantic names the member of a union it tried in `loc` ('str', 'list[constrained-int]'): not a field."""
    return isinstance(part, str) and (
        "[" in part or part in _UNION_TAGS or part.startswith(("constrained-", "function-"))
    )


_UNION_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


# --------------------------------------------------------------------------------------------- requests

Name = Annotated[str, StringConstraints(min_length=1, max_length=256)]
StopString = Annotated[str, StringConstraints(min_length=1, max_length=256)]
BadWord = Annotated[str, StringConstraints(min_length=1, max_length=256)]
TokenId = Annotated[int, Field(ge=0, lt=2**31)]


class MoloraOptions(_Strict):
    """molora's own request options: how to route, over which adapters, and whether to report it."""

    # arrow, arrow-token, hybrid: the named routers, the same as `molora route --router NAME` (molora.routing.names)
    routing: Literal["auto", "learned", "arrow", "arrow-token", "hybrid", "vocab", "sequence"] = "auto"
    adapters: list[Name] | None = Field(None, max_length=256)
    # a static mix: every token on the weighted sum of these adapters' deltas ({"a": 0.7, "b": 0.3}), or the name of
    # a registered mix (POST /v1/mixes); weights within the server's bound (molora.routing.mix)
    mix: dict[Name, float] | Name | None = None
    scale: float | None = None  # the pinned adapter's weight (model=<adapter>); 1: its plain delta
    return_routing: bool = False
    timeout: float | None = Field(None, gt=0.0)  # seconds; None: the server's default (capped by the server)


class StreamOptions(_Strict):
    include_usage: bool = False


class JsonSchemaFormat(_Strict):
    """OpenAI's response_format.json_schema. molora always constrains; `strict: true` also refuses (400) a schema
    with keywords the grammar engine accepts but does not enforce (molora.structured.unenforced)."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False, populate_by_name=True)
    name: Annotated[str, StringConstraints(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    """OpenAI's response_format: text (no constraint), json_object (any JSON object), json_schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Strict):
    """vLLM's `structured_outputs` extension: exactly one of json (a schema), regex, choice, grammar (EBNF),
    json_object. `disable_any_whitespace` is accepted (molora's JSON never has free whitespace)."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False, populate_by_name=True)
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool | None = None


class GenerationRequest(_Strict):
    model: Name
    max_tokens: int | None = Field(None, ge=1, lt=INT64)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, lt=2**31)  # extension (vLLM has it too); 0 = off
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: StopString | list[StopString] | None = None
    seed: int | None = Field(None, ge=-INT64, lt=INT64)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = Field(None, max_length=MAX_LOGIT_BIAS)  # "token id" -> bias: token_bias()
    # the request's tenant when its API key has no name (molora.server.tenants): a label in logs and /metrics
    user: str | None = Field(None, max_length=256)
    priority: int = Field(0, ge=-INT64, lt=INT64)  # vLLM's: lower first under --scheduling-policy priority
    # OpenAI's stored-completions fields: molora stores nothing, so they are accepted and not used
    store: bool | None = None
    metadata: (
        dict[Annotated[str, StringConstraints(max_length=64)], Annotated[str, StringConstraints(max_length=512)]] | None
    ) = Field(None, max_length=16)
    # vLLM's stop_token_ids: generation also ends at these ids (besides the model's own end ids)
    stop_token_ids: list[TokenId] | None = Field(None, max_length=MAX_STOP_IDS)
    # vLLM's extensions (top-level body fields, as vLLM takes them; see SamplingParams for the semantics):
    # ignore_eos generates past the model's end-of-sequence ids, min_tokens forbids stopping before that many
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, lt=INT64)
    # repetition_penalty (1 = off) scales the logits of ids seen in prompt or output, min_p (0 = off) drops ids
    # less likely than min_p times the top one, bad_words are never generated (tokenized by the server)
    repetition_penalty: float = Field(1.0, ge=1e-4, le=1e4)  # molora.config.MAX_REPETITION_PENALTY
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    bad_words: list[BadWord] | None = Field(None, max_length=MAX_BAD_WORDS)
    # vLLM's prompt_logprobs: each prompt token's logprob with the top N alternatives, in vLLM's shape
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    molora: MoloraOptions | None = None
    # structured output: OpenAI's response_format, vLLM's structured_outputs and its older guided_* fields
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @field_validator(
        "temperature",
        "top_p",
        "top_k",
        "n",
        "stream",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "min_p",
        mode="before",
    )
    @classmethod
    def _null_means_default(cls, value: Any, info: ValidationInfo) -> Any:
        # OpenAI accepts null for these (some clients send it): the default applies
        return cls.model_fields[info.field_name].default if value is None else value

    def stop_strings(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOP:
            raise APIError(400, f"stop holds {len(stops)} strings; at most {MAX_STOP} are allowed", param="stop")
        return tuple(stops)

    def token_bias(self, vocab_size: int) -> dict[int, float]:
        """logit_bias as {token id: bias}: each key a token id written in decimal, in [0, vocab_size), each bias in
        [-100, 100] (OpenAI's range); a 400 naming logit_bias and the key otherwise."""
        out: dict[int, float] = {}
        for key, bias in (self.logit_bias or {}).items():
            token = int(key) if key.isascii() and key.isdigit() else -1
            if not 0 <= token < vocab_size:
                raise APIError(
                    400,
                    f"logit_bias key {key[:40]!r} is not a token id of this model (a decimal integer in "
                    f"[0, {vocab_size}))",
                    param="logit_bias",
                )
            if not -100.0 <= bias <= 100.0:
                raise APIError(400, f"logit_bias[{key!r}]={bias} must lie in [-100, 100]", param="logit_bias")
            out[token] = bias
        return out

    def check_supported(self) -> None:
        """Refuse, with a 400 naming the parameter, what molora accepts syntactically but does not do."""
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed with stream=true", param="stream_options")
        self.stop_strings()

    @property
    def options(self) -> MoloraOptions:
        return self.molora or MoloraOptions()

    def prompt_top(self) -> int | None:
        """The top-n alternatives per prompt token the engine scores the prompt with (SamplingParams.
        prompt_logprobs); None: the prompt is not scored."""
        if self.prompt_logprobs is not None and self.stream:  # as vLLM: a stream has no place for them
            raise APIError(400, "prompt_logprobs is not available with stream=true", param="prompt_logprobs")
        return self.prompt_logprobs

    def structured_spec(self) -> tuple[StructuredSpec, str] | None:
        """(what the output must match, the parameter that asked) or None; 400 when more than one asks or one
        is malformed. Compiling (and its 400s) is the caller's, off the event loop."""
        asked: list[tuple[str, str, Any]] = []  # (param, kind, value)
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            asked.append(("response_format", "json_object", None))
        if rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise APIError(
                    400,
                    "response_format type json_schema needs json_schema.schema (and a name)",
                    param="response_format.json_schema",
                )
            asked.append(
                (
                    "response_format.json_schema.schema",
                    "json_schema",
                    (rf.json_schema.schema_, bool(rf.json_schema.strict)),
                )
            )
        if rf is not None and rf.type == "text" and rf.json_schema is not None:
            raise APIError(400, "response_format type text takes no json_schema", param="response_format")
        so = self.structured_outputs
        if so is not None:
            for name, kind, value in (
                ("json", "json_schema", so.json_),
                ("regex", "regex", so.regex),
                ("choice", "choice", so.choice),
                ("grammar", "grammar", so.grammar),
                ("json_object", "json_object", True if so.json_object else None),
            ):
                if value is not None:
                    asked.append((f"structured_outputs.{name}", kind, value))
        for name, kind in (
            ("guided_json", "json_schema"),
            ("guided_regex", "regex"),
            ("guided_choice", "choice"),
            ("guided_grammar", "grammar"),
        ):
            if getattr(self, name) is not None:
                asked.append((name, kind, getattr(self, name)))
        if not asked:
            return None
        if len(asked) > 1:
            raise APIError(
                400, f"ask for one structured output, not {len(asked)}: {[a[0] for a in asked]}", param=asked[1][0]
            )
        param, kind, value = asked[0]
        try:
            if kind == "json_schema":
                schema, strict = value if isinstance(value, tuple) else (value, False)
                return StructuredSpec.json_schema(schema, strict), param
            if kind == "choice":
                return StructuredSpec.choice(value), param
            return StructuredSpec(kind, value or ""), param  # type: ignore[arg-type]
        except StructuredOutputError as e:
            raise APIError(400, str(e), param=param) from e


class CompletionRequest(GenerationRequest):
    """POST /v1/completions. `prompt`: a string, a list of strings, token ids, or a list of token-id lists."""

    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    max_tokens: int | None = Field(16, ge=0, lt=INT64)  # OpenAI's default for completions; 0 only with echo
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=MAX_N)

    def check_supported(self) -> None:
        super().check_supported()
        if self.max_tokens == 0 and not self.echo:
            raise APIError(
                400,
                "max_tokens=0 generates nothing; it is allowed with echo=true (to score the prompt)",
                param="max_tokens",
            )
        if self.suffix:
            raise APIError(400, "suffix (insertion) is not supported by molora", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise APIError(400, f"best_of={self.best_of} is not supported (only best_of == n)", param="best_of")
        if isinstance(self.prompt, list) and not self.prompt:
            raise APIError(400, "prompt is an empty list; send a string or token ids", param="prompt")
        if isinstance(self.prompt, list) and isinstance(self.prompt[0], (str, list)) and len(self.prompt) > MAX_BATCH:
            raise APIError(400, f"{len(self.prompt)} prompts in one request; at most {MAX_BATCH}", param="prompt")

    def prompt_top(self) -> int | None:
        """echo with logprobs scores the prompt too (its tokens lead choices[].logprobs), as does prompt_logprobs."""
        asked = [n for n in (super().prompt_top(), self.logprobs if self.echo else None) if n is not None]
        return max(asked) if asked else None

    def prompt_list(self) -> list[str | list[int]]:
        """Each prompt of the call (a batch is several): text or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class ContentPart(_Strict):
    type: Literal["text"]
    text: str


FunctionName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")]


class FunctionDefinition(_Strict):
    """A tool's function: `parameters` is a JSON schema of its arguments object (left out: no arguments)."""

    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: FunctionName


class NamedToolChoice(_Strict):
    """tool_choice naming the one function the answer must call."""

    type: Literal["function"]
    function: NamedFunction


class FunctionCall(_Strict):
    name: FunctionName
    arguments: str  # a JSON object, as text (OpenAI's form)


class ToolCall(_Strict):
    """One call of an assistant message: what a client sends back in `messages` and what a response holds."""

    id: Annotated[str, StringConstraints(min_length=1, max_length=256)]
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = Field(None, max_length=128)  # assistant: the calls it made
    tool_call_id: str | None = None  # tool: the call this message answers

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(GenerationRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1, max_length=1024)
    max_completion_tokens: int | None = Field(None, ge=1, lt=INT64)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # tool calling (molora.server.tools: rendering, parsing, the grammar of required and named choices)
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    # vLLM's chat template variables (e.g. Qwen3's enable_thinking), passed to the tokenizer's own chat template
    chat_template_kwargs: dict[TemplateKey, JSONScalar | list[JSONScalar]] | None = Field(None, max_length=16)

    def check_supported(self) -> None:
        super().check_supported()
        reserved = sorted(set(self.chat_template_kwargs or ()) & RESERVED_TEMPLATE_KEYS)
        if reserved:
            raise APIError(
                400,
                f"chat_template_kwargs may not set {reserved}: the server renders those itself",
                param="chat_template_kwargs",
            )
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise APIError(400, "send max_tokens or max_completion_tokens, not both", param="max_tokens")

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class AdapterLoadRequest(_Strict):
    """POST /v1/adapters: load the PEFT folder at `path` (under a configured root) as `name` into `bundle`
    (may be left out where the server serves one bundle)."""

    name: Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,63}$")]
    path: Annotated[str, StringConstraints(min_length=1, max_length=4096)]
    bundle: str | None = None


class MixRequest(_Strict):
    """POST /v1/mixes: register (or replace) the named mix `name` -> `adapters` ({adapter: weight}) in `bundle` (may
    be left out where the server serves one bundle); requests then name it as a model or as `molora.mix`."""

    name: Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,63}$")]
    adapters: dict[Name, float] = Field(max_length=256)
    bundle: str | None = None
    # true: the bundle's in-network router (learned or arrow) takes the mix as one of its experts, false: no longer,
    # left out: as before (Engine.add_mix)
    router_expert: bool | None = None


class LoadLoRAAdapterRequest(BaseModel):
    """vLLM's POST /v1/load_lora_adapter (same admin key and adapter-root confinement as POST /v1/adapters)."""

    model_config = ConfigDict(extra="ignore")
    lora_name: Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,63}$")]
    lora_path: Annotated[str, StringConstraints(min_length=1, max_length=4096)]
    load_inplace: bool = False


class UnloadLoRAAdapterRequest(BaseModel):
    """vLLM's POST /v1/unload_lora_adapter."""

    model_config = ConfigDict(extra="ignore")
    lora_name: Annotated[str, StringConstraints(min_length=1, max_length=64)]
    lora_int_id: int | None = None


# -------------------------------------------------------------------------------------------- responses


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens served from the engine's prefix cache


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = PromptTokensDetails()  # OpenAI's field


def _absent(v: Any) -> bool:
    return v is None


class Chosen(BaseModel):
    """The per-request chooser's decision (`--router hybrid`): the adapter the request ran on (None: the base model),
    the share of the prompt's last tokens Arrow claimed, and each adapter's confidence z over the base model's pool."""

    kind: str
    adapter: str | None
    share: float
    z: dict[str, float]


class Routed(BaseModel):
    """molora's extension of a choice: with return_routing, each generated token's id and the adapter it was routed
    to (None: the base model); for a structured-output answer that ended ("stop") but breaks its spec (a keyword
    the grammar engine accepts and does not enforce, see molora.structured.unenforced, or a stop string that cut
    it), `structured_output_error` says where and how."""

    token_ids: list[int] | None = Field(None, exclude_if=_absent)
    adapters: list[str | None] | None = Field(None, exclude_if=_absent)
    structured_output_error: str | None = Field(None, exclude_if=_absent)
    # --router hybrid: what the per-request chooser picked for this choice's prompt (molora.server.choosing)
    chooser: Chosen | None = Field(None, exclude_if=_absent)


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]  # None: an echoed prompt's first token (nothing before it to predict it)
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprob(BaseModel):
    """One entry of vLLM's prompt_logprobs (a prompt token or one of its top alternatives)."""

    logprob: float
    rank: int | None = None
    decoded_token: str


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    # per prompt token {token id: entry} (its own id and the top n), None for the first; vLLM's field
    prompt_logprobs: list[dict[int, PromptLogprob] | None] | None = Field(None, exclude_if=_absent)
    molora: Routed | None = Field(None, exclude_if=_absent)


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = Field(None, exclude_if=_absent)


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    molora: Routed | None = Field(None, exclude_if=_absent)


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None
    prompt_logprobs: list[dict[int, PromptLogprob] | None] | None = Field(None, exclude_if=_absent)  # vLLM's


class FunctionCallDelta(BaseModel):
    name: str | None = Field(None, exclude_if=_absent)
    arguments: str = ""


class ToolCallDelta(BaseModel):
    """A stream's piece of a tool call, in OpenAI's shape (molora sends each call whole, in one piece)."""

    index: int
    id: str | None = Field(None, exclude_if=_absent)
    type: Literal["function"] | None = Field(None, exclude_if=_absent)
    function: FunctionCallDelta


class Delta(BaseModel):
    role: Literal["assistant"] | None = Field(None, exclude_if=_absent)
    content: str | None = Field(None, exclude_if=_absent)
    tool_calls: list[ToolCallDelta] | None = Field(None, exclude_if=_absent)


class ChatChunkChoice(BaseModel):
    index: int
    delta: Delta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    molora: Routed | None = Field(None, exclude_if=_absent)


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = Field(None, exclude_if=_absent)


class CompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = Field(None, exclude_if=_absent)


class ModelCard(BaseModel):
    """One entry of /v1/models, in vLLM's form: an adapter's `parent` is its base's id, `root` its folder."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "molora"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None
    adapter: str | None = None  # the adapter a request naming this id pins; None for the base name
    mix: dict[str, float] | None = Field(None, exclude_if=_absent)  # a named mix: the adapters it weighs


class ModelList(BaseModel):
    """GET /v1/models. With `?limit=N` and/or `?after=ID` (a server with thousands of adapters) one page, with
    the cursor fields of OpenAI's paginated lists; without them every model and no cursor fields."""

    object: Literal["list"] = "list"
    data: list[ModelCard]
    first_id: str | None = Field(None, exclude_if=_absent)
    last_id: str | None = Field(None, exclude_if=_absent)
    has_more: bool | None = Field(None, exclude_if=_absent)
