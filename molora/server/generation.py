"""/v1/completions and /v1/chat/completions: from a validated request to engine requests and back.

Owns: choosing the model and routing (`bundle` = per-token routing, or with --router hybrid the per-request
chooser's pick, molora.server.choosing; `bundle:adapter` = one pinned adapter; the `molora` options), turning
prompts into token ids (raw text for completions; for chat the bundle's prompt template on a single user message,
else the tokenizer's chat template), context-length and vocabulary checks, `SamplingParams` per choice (n choices
and batched prompts are one engine request each), and the two ways back: one JSON response, or SSE chunks ending
in `data: [DONE]`. A client that disconnects (mid-stream, or while waiting for a non-streamed answer) aborts its
engine requests.

Time: every request has a deadline (`molora.timeout`, else the server's default, at most its cap) and a
queue timeout, both enforced by the engine at step boundaries (KV blocks and pins are freed at once); the
handler also stops waiting at the deadline plus a grace period in case the engine itself is stuck. An expired
request answers 504 (`code: "timeout"`), one that never left the queue 503 with Retry-After
(`code: "queue_timeout"`); a stream gets the choice's `finish_reason: "timeout"` and then the error event.
A request the engine ended alone on a fault of its own (finish_reason "error") answers 500 naming the cause.
A stream that waits longer than `keepalive_s` for its next token gets an SSE comment (`: keep-alive`) so that
proxies keep the connection. Tokenising a large prompt runs on a worker thread, not on the event loop.

Structured output (`response_format` json_object / json_schema, vLLM's `structured_outputs` and `guided_*`): the
spec is compiled for the bundle's tokenizer on a worker thread (`molora.structured.StructuredCompiler`, one per
bundle, cached by spec) before anything is queued; a spec too large or that does not compile answers 400 naming
the problem. The compiled constraint rides along with each engine request; a choice whose grammar dead-ends
ends alone with finish_reason "error" and the constraint's message.

Knows nothing of engines (it talks to an `EngineClient`: in process or through Ray Serve), auth, adapters
management or metrics rendering; it reports each finished choice to `ServerMetrics`. A server may serve
several bundles (molora.server.catalog: `Catalog`); each request resolves its model to one bundle's `ModelInfo`.
The wire shapes (JSON responses, stream chunks, usage, the SSE response) live in molora.server.openai_format.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from molora.config import SamplingParams
from molora.engine.choosing import CHOOSER_FAILED
from molora.errors import AdapterDraining, AdapterNotFound, MoLoRAError, RoutingError
from molora.server import choosing, tools
from molora.server.catalog import Catalog, ModelInfo
from molora.server.client import EngineClient
from molora.server.metrics import ServerMetrics
from molora.server.openai_format import (
    ChatFormat,
    ChoiceState,
    CompletionFormat,
    ResponseFormat,
    SSEResponse,
    sse,
    usage_of,
)
from molora.server.protocol import APIError, ChatCompletionRequest, CompletionRequest, GenerationRequest
from molora.server.runner import EngineFailure, RequestSpec, Submission
from molora.server.special_tokens import Shield
from molora.server.tenants import TenantLimitExceeded, Tenants, tenant_of
from molora.structured import GrammarConstraint, StructuredCompiler, StructuredOutputError, StructuredSpec

log = logging.getLogger("molora.server")
__all__ = ["OFFLOAD_CHARS", "REPLICA_HEADER", "Catalog", "Generation", "Limits", "ModelInfo"]

OFFLOAD_CHARS = 32 << 10  # prompts longer than this are tokenised on a worker thread
REPLICA_HEADER = "X-Molora-Replica"  # which engine replica answered (molora serve --ray)

# the API parameter of each part of a request's routing (molora.engine.admission.RoutingRequest), for a 400's param
ROUTING_PARAMS = {
    "mode": "molora.routing",
    "adapter": "model",
    "allowed": "molora.adapters",
    "mix": "molora.mix",
    "scale": "molora.scale",
}


@dataclass(frozen=True)
class Limits:
    """Time limits of the generation endpoints (seconds). request_timeout_s: the default deadline of a request;
    max_request_timeout_s: the most a request may ask for (`molora.timeout`); queue_timeout_s: how long a
    request may wait before it starts (None: no limit); keepalive_s: SSE comment interval while a stream waits;
    deadline_grace_s: how long past a request's deadline the handler waits for the engine to end it before it
    answers 504 on its own (the backstop for a stalled engine; the engine normally ends it at a step boundary)."""

    request_timeout_s: float = 600.0
    max_request_timeout_s: float = 3600.0
    queue_timeout_s: float | None = 300.0
    keepalive_s: float = 15.0
    deadline_grace_s: float = 2.0

    def __post_init__(self) -> None:
        for name in ("request_timeout_s", "max_request_timeout_s", "keepalive_s", "deadline_grace_s"):
            if not getattr(self, name) > 0:
                raise MoLoRAError(f"{name}={getattr(self, name)} must be > 0")
        if self.queue_timeout_s is not None and not self.queue_timeout_s > 0:
            raise MoLoRAError(f"queue_timeout_s={self.queue_timeout_s} must be > 0 (or None: no limit)")
        if self.request_timeout_s > self.max_request_timeout_s:
            raise MoLoRAError(
                f"request_timeout_s={self.request_timeout_s} exceeds max_request_timeout_s={self.max_request_timeout_s}"
            )

    def timeout(self, asked: float | None) -> float:
        if asked is None:
            return self.request_timeout_s
        if asked > self.max_request_timeout_s:
            raise APIError(
                400,
                f"molora.timeout={asked:g} s exceeds this server's cap of "
                f"{self.max_request_timeout_s:g} s; ask for less",
                param="molora.timeout",
            )
        return asked


class Generation:
    """The two generation endpoints over one `EngineClient`."""

    def __init__(
        self,
        client: EngineClient,
        metrics: ServerMetrics,
        catalog: Catalog,
        limits: Limits = Limits(),
        resolver: Callable[[str], Awaitable[bool]] | None = None,
        tenants: Tenants | None = None,
        retry_after_s: int = 1,
    ) -> None:
        self.client, self.metrics, self.catalog, self.limits = client, metrics, catalog, limits
        self.tenants = tenants if tenants is not None else Tenants()
        self.retry_after_s = retry_after_s
        self._compilers: dict[str, StructuredCompiler] = {}  # bundle name -> its tokenizer's compiler
        self._compilers_lock = threading.Lock()
        self.resolver = resolver  # loads an adapter a request names on first use (--lora-resolver-dir)

    async def resolve(self, model: str) -> tuple[ModelInfo, str | None]:
        """`Catalog.resolve`, after giving the resolver (if any) a chance to load an unknown adapter name."""
        try:
            return self.catalog.resolve(model)
        except APIError as e:
            if e.status != 404 or self.resolver is None or not await self.resolver(model):
                raise
        return self.catalog.resolve(model)

    # ------------------------------------------------------------------------------------ endpoints
    async def completions(self, req: CompletionRequest, request: Request) -> Response:
        req.check_supported()
        info, adapter = await self.resolve(req.model)
        items = req.prompt_list()
        size = sum(len(p) for p in items if isinstance(p, str))
        prompts = await _offload(size, lambda: [_encode_completion(info, p, i) for i, p in enumerate(items)])
        fmt = CompletionFormat(info, "cmpl-" + uuid.uuid4().hex, req)
        ask = [choosing.completion_question(info, p) for p in items] if choosing.applies(info, adapter, req) else None
        return await self._run(req, info, adapter, prompts, req.max_tokens, req.logprobs, fmt, request, ask)

    async def chat(self, req: ChatCompletionRequest, request: Request) -> Response:
        req.check_supported()
        info, adapter = await self.resolve(req.model)
        calls = tools.check(req, info)  # tools, tool_choice and the messages' tool calls (molora.server.tools)
        prompt = await _offload(sum(len(m.text()) for m in req.messages), lambda: _encode_chat(info, req))
        top = (req.top_logprobs or 0) if req.logprobs else None
        fmt = ChatFormat(info, "chatcmpl-" + uuid.uuid4().hex, req)
        fmt.tools = calls
        ask = [choosing.chat_question(req)] if choosing.applies(info, adapter, req) else None
        return await self._run(req, info, adapter, [prompt], req.token_limit, top, fmt, request, ask)

    # ------------------------------------------------------------------------------------ requests
    def _specs(
        self,
        req: GenerationRequest,
        info: ModelInfo,
        adapter: str | None,
        prompts: Sequence[list[int]],
        max_tokens: int | None,
        logprobs: int | None,
        constraint: GrammarConstraint | None = None,
    ) -> list[RequestSpec]:
        opts = req.options  # its routing is checked once, by the engine's admission (RoutingError: `_submit`)
        mix = opts.mix
        if adapter is not None and adapter in info.mixes and adapter not in info.adapters:  # model=<named mix>
            if mix is not None:
                raise APIError(
                    400,
                    f"model {adapter!r} is a named mix; send molora.mix or that model, not both",
                    param="molora.mix",
                )
            mix, adapter = adapter, None
        stop = req.stop_strings()
        logit_bias = req.token_bias(info.vocab_size)
        bad_words = _bad_words_ids(info, req.bad_words or [])
        prompt_top = req.prompt_top()  # echo with logprobs, or prompt_logprobs: the engine scores the prompt
        timeout = self.limits.timeout(opts.timeout)
        specs = []
        # ignore_eos drops the model's end ids (tokenizer eos, the bundle's end of turn): vLLM's generation-config
        # eos ids; the body's stop_token_ids (vLLM's) still end it, as stop strings and length do
        bad = [t for t in req.stop_token_ids or [] if t >= info.vocab_size]
        if bad:
            raise APIError(
                400,
                f"stop_token_ids {bad[:5]} lie outside the vocabulary [0, {info.vocab_size})",
                param="stop_token_ids",
            )
        asked = tuple(dict.fromkeys(req.stop_token_ids or ()))
        stop_ids = asked if req.ignore_eos else tuple(dict.fromkeys([*info.stop_token_ids, *asked]))
        for p, ids in enumerate(prompts):
            new_tokens = _budget(info, ids, max_tokens)
            if req.min_tokens > new_tokens:
                raise APIError(
                    400,
                    f"min_tokens={req.min_tokens} exceeds this completion's token budget of "
                    f"{new_tokens} (max_tokens, or what the context leaves); lower min_tokens or raise "
                    "max_tokens",
                    param="min_tokens",
                )
            for j in range(req.n):
                try:
                    params = SamplingParams(
                        max_new_tokens=new_tokens,
                        temperature=req.temperature,
                        top_p=req.top_p,
                        top_k=req.top_k,
                        seed=None if req.seed is None else req.seed + j,
                        stop_token_ids=stop_ids,
                        stop=stop,
                        logprobs=0 if logprobs is None else max(logprobs, 1),
                        ignore_eos=req.ignore_eos,
                        min_tokens=req.min_tokens,
                        presence_penalty=req.presence_penalty,
                        frequency_penalty=req.frequency_penalty,
                        repetition_penalty=req.repetition_penalty,
                        min_p=req.min_p,
                        logit_bias=logit_bias,
                        bad_words_ids=bad_words,
                        prompt_logprobs=prompt_top,
                    )
                except MoLoRAError as e:
                    raise APIError(400, str(e)) from e
                specs.append(
                    RequestSpec(
                        p * req.n + j,
                        ids,
                        params,
                        adapter,
                        opts.adapters,
                        opts.routing,
                        timeout_s=timeout,
                        queue_timeout_s=self.limits.queue_timeout_s,
                        constraint=constraint,
                        priority=req.priority,
                        mix=mix,
                        scale=opts.scale,
                    )
                )
        return specs

    # ------------------------------------------------------------------------------------ running
    async def _run(
        self,
        req: GenerationRequest,
        info: ModelInfo,
        adapter: str | None,
        prompts: list[list[int]],
        max_tokens: int | None,
        logprobs: int | None,
        fmt: ResponseFormat,
        request: Request,
        questions: list[str] | None = None,
    ) -> Response:
        """questions: per prompt, the text the engine's per-request chooser reads (None: it does not decide this
        request); each of its engine requests is routed "hybrid" and reports the pick on its first output."""
        constraint = fmt.constraint = await self._constraint(req, info)
        specs = self._specs(req, info, adapter, prompts, max_tokens, logprobs, constraint)
        if len(specs) > self.client.max_in_flight:
            raise APIError(
                400,
                f"this request needs {len(specs)} engine requests (n x prompts), more than the "
                f"server admits at once ({self.client.max_in_flight}); lower n or split the batch",
                param="n",
            )
        if questions is not None:  # the engine's chooser picks each prompt's adapter (molora.engine.choosing)
            fmt.chooser = info.chooser
            specs = [dataclasses.replace(s, routing="hybrid", question=questions[s.index // req.n]) for s in specs]
        tenant = tenant_of(getattr(request.state, "key_name", None), req.user, adapter)
        specs = [dataclasses.replace(s, tenant=tenant) for s in specs]
        try:
            self.tenants.admit(tenant, len(specs), sum(len(s.prompt_ids) for s in specs), self.retry_after_s)
        except TenantLimitExceeded as e:
            log.info("%s refused (429): %s", fmt.id, e)
            self.metrics.count_tenant_refusal(tenant, e.limit)
            raise APIError(
                429,
                str(e),
                type="rate_limit_error",
                code="tenant_limit",
                headers={"Retry-After": str(e.retry_after_s)},
            ) from None
        states = [
            ChoiceState(spec.index, len(spec.prompt_ids), prompt_ids=spec.prompt_ids, tenant=tenant) for spec in specs
        ]
        try:
            sub = await self._submit(specs, fmt.id, info.name)
        except BaseException:
            self.tenants.done(tenant, len(specs), 0)
            raise
        log.info("%s: %d engine requests of tenant %r (priority %d)", fmt.id, len(specs), tenant, req.priority)
        sub.on_close(lambda: self.tenants.done(tenant, len(specs), sum(len(st.token_ids) for st in states)))
        deadline = time.monotonic() + specs[0].timeout_s + self.limits.deadline_grace_s
        headers = {REPLICA_HEADER: sub.replica} if sub.replica is not None else None
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return SSEResponse(self._stream(sub, states, fmt, include_usage, req.n, deadline), sub, headers)
        try:
            await _until_done_or_gone(self._collect(sub, states, deadline), request)
        finally:
            sub.close()
        return JSONResponse(fmt.response(states, usage_of(states, req.n)).model_dump(mode="json"), headers=headers)

    async def _submit(self, specs: list[RequestSpec], call_id: str, model: str) -> Submission:
        """`client.submit`, the engine's refusals mapped to 400 / 404 naming the field at fault."""
        try:
            return await self.client.submit(specs, call_id, model)
        except (AdapterDraining, AdapterNotFound) as e:  # not loaded, or unloaded since the model check
            pinned = any(spec.adapter is not None and spec.adapter in str(e) for spec in specs)
            raise APIError(
                404,
                str(e),
                param="model" if pinned else "molora.adapters",
                code="model_not_found" if pinned else "adapter_not_found",
            ) from e
        except RoutingError as e:  # the engine's admission names the routing field at fault
            raise APIError(400, str(e), param=ROUTING_PARAMS.get(e.field or "", "molora.routing")) from e
        except MoLoRAError as e:
            raise APIError(400, str(e)) from e

    async def _constraint(self, req: GenerationRequest, info: ModelInfo) -> GrammarConstraint | None:
        """The request's compiled structured-output constraint (None: none asked); 400 if it cannot be had."""
        asked = tools.structured_spec(req)  # response_format & co, or a required / named tool choice's calls
        if asked is None:
            return None
        spec, param = asked
        try:
            return await asyncio.to_thread(self._compile, info, spec)
        except StructuredOutputError as e:
            param = await asyncio.to_thread(tools.blame, req, param, lambda s: self._compile(info, s))
            raise APIError(400, str(e), param=param, code="invalid_structured_output") from e

    def _compile(self, info: ModelInfo, spec: StructuredSpec) -> GrammarConstraint:
        with self._compilers_lock:  # one compiler per bundle, built once (reading the tokenizer takes ~0.1 s)
            compiler = self._compilers.get(info.name)
            if compiler is None:
                try:
                    compiler = StructuredCompiler(
                        info.tokenizer,
                        vocab_size=info.vocab_size,
                        stop_token_ids=info.stop_token_ids,
                        max_string_chars=info.max_json_string_chars,
                        max_array_items=info.max_json_array_items,
                        max_object_properties=info.max_json_object_properties,
                        max_number_digits=info.max_json_number_digits,
                    )
                except StructuredOutputError:  # the grammar engine is not installed: the message says how
                    raise
                except Exception as e:
                    raise StructuredOutputError(
                        f"model {info.name!r} cannot do structured output: its tokenizer "
                        f"is not one the grammar engine reads ({type(e).__name__}: {e})"
                    ) from e
                self._compilers[info.name] = compiler
        return compiler.compile(spec)

    async def _outputs(
        self, sub: Submission, states: list[ChoiceState], deadline: float, keepalive: float | None = None
    ) -> AsyncIterator[tuple[ChoiceState, Any] | None]:
        """Each output in arrival order, after updating its choice's state; None after `keepalive` seconds
        without one. Raises APIError on an engine failure, a choice the engine ended on an error or a
        deadline (after yielding that choice's last output), and at `deadline` (the handler's backstop)."""
        by_index = {s.index: s for s in states}
        while sub.unfinished:
            left = deadline - time.monotonic()
            if left <= 0:
                if sub.queue.empty():
                    await asyncio.sleep(0)  # outputs the engine thread handed to the loop land first
                if sub.queue.empty():
                    self.metrics.count_deadline("request")
                    raise APIError(
                        504,
                        "the request ran past its deadline and the engine did not end it in time (a stalled engine?)",
                        type="server_error",
                        code="timeout",
                    )
                item = sub.queue.get_nowait()  # what the engine already sent is delivered first
            else:
                wait = left if keepalive is None else min(left, keepalive)
                try:
                    item = await asyncio.wait_for(sub.queue.get(), wait)
                except TimeoutError:
                    if keepalive is not None and wait == keepalive:
                        yield None
                    continue
            if isinstance(item, EngineFailure):
                raise APIError(500, item.message, type="server_error", code="engine_error")
            index, out = item
            state = by_index[index]
            state.update(out, time.perf_counter())
            if out.finished:
                sub.finished(out.request_id)
                self._observe(sub, state)
            yield state, out
            if out.finished and getattr(out, "error", None) is not None:
                raise _ended_by_engine(out)

    async def _collect(self, sub: Submission, states: list[ChoiceState], deadline: float) -> None:
        async for _ in self._outputs(sub, states, deadline):
            pass

    async def _stream(
        self,
        sub: Submission,
        states: list[ChoiceState],
        fmt: ResponseFormat,
        include_usage: bool,
        n: int,
        deadline: float,
    ) -> AsyncIterator[str]:
        pending: list[str] = []
        try:
            for state in states:
                head = fmt.head(state)
                if head is not None:
                    yield sse(head)
            pending: list[str] = []  # events of outputs that arrived together go out as one write
            async for item in self._outputs(sub, states, deadline, self.limits.keepalive_s):
                if item is None:
                    yield ": keep-alive\n\n"
                    continue
                state, out = item
                chunk = fmt.chunk(state, out)
                if chunk is not None:
                    pending.append(sse(chunk))
                if pending and sub.queue.empty():
                    yield "".join(pending)
                    pending = []
            if include_usage:
                pending.append(sse(fmt.usage_chunk(usage_of(states, n))))
            yield "".join(pending) + "data: [DONE]\n\n"
        except APIError as e:  # the engine failed mid-stream: tell the client in-band, as OpenAI does
            yield "".join(pending) + "data: " + json.dumps(e.body()) + "\n\n"
        finally:
            sub.close()

    def _observe(self, sub: Submission, s: ChoiceState) -> None:
        now = time.perf_counter()
        n = len(s.token_ids)
        ttft = s.t_first - sub.arrival if s.t_first is not None else None
        tpot = (s.t_last - s.t_first) / (n - 1) if n > 1 and s.t_first is not None and s.t_last is not None else None
        self.metrics.observe_request(
            ttft=ttft,
            tpot=tpot,
            latency=now - sub.arrival,
            prompt_tokens=s.prompt_tokens,
            completion_tokens=n,
            finish_reason=s.finish_reason,
            tenant=s.tenant,
            adapters=s.adapters,
            gaps=s.gaps,
        )


def _bad_words_ids(info: ModelInfo, words: Sequence[str]) -> tuple[tuple[int, ...], ...]:
    """The token-id sequences the engine bans (SamplingParams.bad_words_ids), tokenized as vLLM does: each word
    as written (leading whitespace stripped) and, when the tokenizer gives the word another first token after a
    space (a word inside the text) in as many tokens, that form too."""
    out: dict[tuple[int, ...], None] = {}  # ordered, without duplicates
    for word in words:
        plain = tuple(info.tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = tuple(info.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if not plain:
            raise APIError(400, f"bad_words entry {word[:40]!r} gives no token", param="bad_words")
        forms = [plain] + ([spaced] if spaced and spaced[0] != plain[0] and len(spaced) == len(plain) else [])
        for ids in forms:
            if any(not 0 <= t < info.vocab_size for t in ids):
                raise APIError(
                    400, f"bad_words entry {word[:40]!r} tokenizes outside the model's vocabulary", param="bad_words"
                )
            out[ids] = None
    return tuple(out)


def _encode_completion(info: ModelInfo, prompt: str | list[int], i: int) -> list[int]:
    if isinstance(prompt, str):
        return list(info.tokenizer.encode(prompt, add_special_tokens=True))
    bad = [t for t in prompt if t >= info.vocab_size]
    if bad:
        raise APIError(
            400, f"prompt[{i}] holds token ids {bad[:5]} outside the vocabulary [0, {info.vocab_size})", param="prompt"
        )
    return list(prompt)


def _encode_chat(info: ModelInfo, req: ChatCompletionRequest) -> list[int]:
    tok, msgs = info.tokenizer, req.messages
    shield = Shield(tok) if not info.allow_special_tokens_in_chat else None  # typed special tokens are text
    hide = shield.hide if shield is not None else (lambda v: v)
    if info.prompt_template is not None and len(msgs) == 1 and msgs[0].role == "user" and not req.tools:
        text = info.prompt_template.replace("{prompt}", hide(msgs[0].text()))
    elif getattr(tok, "chat_template", None):
        conversation, extra = tools.conversation(req, tok)  # with tools: `tools=`, or molora's default rendering
        conversation, extra = hide(conversation), hide(extra)
        try:
            extra = {**(req.chat_template_kwargs or {}), **extra}  # the server's own variables win (checked too)
            text = tok.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False, **extra)
        except Exception as e:  # jinja templates raise on conversations they do not accept
            raise APIError(400, f"the chat template refused these messages: {e}", param="messages") from e
    else:
        raise APIError(
            400,
            "this model has no chat template for system or multi-turn messages; send one "
            "user message, or use /v1/completions with your own prompt",
            param="messages",
        )
    return shield.encode(text) if shield is not None else list(tok.encode(text, add_special_tokens=False))


def _budget(info: ModelInfo, ids: list[int], max_tokens: int | None) -> int:
    """New tokens for a prompt: max_tokens, or the default capped by the context left."""
    if not ids:
        raise APIError(400, "the prompt is empty (0 tokens); send some text", param="prompt")
    ctx = info.max_model_len
    if ctx is None:
        return max_tokens if max_tokens is not None else info.default_max_tokens  # 0: echo scores the prompt only
    if max_tokens is None:
        max_tokens = min(info.default_max_tokens, ctx - len(ids))
    if len(ids) + max(max_tokens, 1) > ctx:
        raise APIError(
            400,
            f"This model's maximum context length is {ctx} tokens. However, you requested "
            f"{len(ids) + max_tokens} tokens ({len(ids)} in the prompt, {max_tokens} for the "
            "completion). Please reduce the length of the prompt or the completion.",
            param="max_tokens" if len(ids) < ctx else "prompt",
            code="context_length_exceeded",
        )
    return max_tokens


def _ended_by_engine(out: Any) -> APIError:
    """The error a choice the engine ended on its own (deadline, fault, forced unload) answers with."""
    if out.finish_reason == "timeout":
        if out.error.startswith("queue timeout"):  # the engine names which deadline (RequestLifecycle.expire)
            return APIError(503, out.error, type="server_error", code="queue_timeout", headers={"Retry-After": "1"})
        return APIError(504, out.error, type="server_error", code="timeout")
    if out.error.startswith(CHOOSER_FAILED):  # the per-request chooser raised on this request (it ended alone)
        return APIError(500, out.error, type="server_error", code="chooser_error")
    if out.error.startswith("constraint dead end"):  # the request's own spec (with ignore_eos or min_tokens)
        return APIError(400, out.error, code="structured_output_dead_end")
    return APIError(
        500, out.error, type="server_error", code="engine_error" if out.finish_reason == "error" else "request_aborted"
    )


async def _offload(size: int, fn: Any) -> Any:
    """fn() on a worker thread when the input is large (keeps the event loop and other streams moving)."""
    return await asyncio.to_thread(fn) if size > OFFLOAD_CHARS else fn()


async def _until_done_or_gone(work: Any, request: Request) -> None:
    """Await `work`; if the client disconnects first, cancel it and raise (the caller aborts)."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
    if not task.done() or task.cancelled():
        raise APIError(499, "client closed the request", code="client_disconnected")
    task.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
