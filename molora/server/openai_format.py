"""The OpenAI wire shapes of the generation endpoints: what a choice has produced, and how it is written.

`ChoiceState` gathers one choice's outputs (text, ids, adapters, logprobs, finish reason, first and last token
times); `CompletionFormat` and `ChatFormat` (one `ResponseFormat` per endpoint) write the choices as one JSON
response or as stream chunks, with logprobs and molora's routed adapters where asked; `usage_of` counts usage
as OpenAI does; `sse` frames a chunk and `SSEResponse` is the event stream that aborts its engine requests
however it ends. Knows nothing of engines, routing or limits (molora.server.generation drives them).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from molora.server.catalog import ModelInfo
from molora.server.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessageOut,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionResponse,
    Delta,
    PromptTokensDetails,
    Routed,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from molora.server.runner import Submission
from molora.structured import GrammarConstraint


@dataclass
class ChoiceState:
    """What one choice has produced so far, and when (for TTFT/TPOT)."""

    index: int
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of the prompt, from the prefix cache (reported when it finishes)
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    adapters: list[str | None] = field(default_factory=list)
    logprobs: list[dict] = field(default_factory=list)
    finish_reason: str | None = None
    t_first: float | None = None
    t_last: float | None = None

    def update(self, out: Any, now: float) -> None:
        self.prompt_tokens = out.prompt_tokens
        self.cached_tokens = getattr(out, "cached_tokens", 0)
        self.text += out.new_text
        self.token_ids += out.new_token_ids
        self.adapters += out.token_adapters
        self.logprobs += out.logprobs or []
        if out.new_token_ids:
            self.t_first = self.t_first if self.t_first is not None else now
            self.t_last = now
        if out.finished:
            self.finish_reason = out.finish_reason


def usage_of(states: list[ChoiceState], n: int) -> Usage:
    """Prompt tokens once per prompt (not per choice, as OpenAI counts n), completion tokens of all choices."""
    prompt = sum(s.prompt_tokens for s in states if s.index % n == 0)
    cached = sum(s.cached_tokens for s in states if s.index % n == 0)
    completion = sum(len(s.token_ids) for s in states)
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )


def sse(chunk: BaseModel) -> str:
    return "data: " + chunk.model_dump_json() + "\n\n"


class SSEResponse(StreamingResponse):
    """An event stream that aborts its engine requests however it ends (done, disconnect, cancellation)."""

    def __init__(self, chunks: AsyncIterator[str], sub: Submission, headers: dict[str, str] | None = None) -> None:
        super().__init__(
            chunks,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})},
        )
        self.sub = sub

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.sub.close()


# ------------------------------------------------------------------------------------------ formats
class ResponseFormat:
    """How one endpoint writes choices: the full response, the stream chunks, the usage chunk."""

    def __init__(self, info: ModelInfo, id: str, req: Any) -> None:
        self.info, self.id, self.req = info, id, req
        self.created = int(time.time())
        self.routing = req.options.return_routing
        self.constraint: GrammarConstraint | None = None  # the request's structured output, set once compiled
        self.chosen: list[dict] | None = None  # per prompt, the per-request chooser's pick (molora.server.choosing)

    def _routed(
        self, token_ids: list[int], adapters: list[str | None], ended: ChoiceState | None = None
    ) -> Routed | None:
        """The choice's molora extension: its routing (return_routing) and, once it has `ended`, why its answer
        breaks the request's structured-output spec (GrammarConstraint.check), if it does, and what the per-request
        chooser picked for its prompt, if one did."""
        why = None
        if ended is not None and ended.finish_reason == "stop" and self.constraint is not None:
            why = self.constraint.check(ended.text)
        chosen = self.chosen[ended.index // self.req.n] if ended is not None and self.chosen else None
        if not self.routing and why is None and chosen is None:
            return None
        routed: dict[str, Any] = {"token_ids": list(token_ids), "adapters": list(adapters)} if self.routing else {}
        return Routed(**routed, structured_output_error=why, chooser=chosen)

    def _token(self, token_id: int) -> str:
        return self.info.tokenizer.decode([token_id])

    def head(self, state: ChoiceState) -> BaseModel | None:
        return None

    def response(self, states: list[ChoiceState], usage: Usage) -> BaseModel:
        raise NotImplementedError

    def chunk(self, state: ChoiceState, out: Any) -> BaseModel | None:
        raise NotImplementedError

    def usage_chunk(self, usage: Usage) -> BaseModel:
        raise NotImplementedError


class CompletionFormat(ResponseFormat):
    def _logprobs(self, entries: list[dict], offset: int) -> CompletionLogprobs | None:
        if self.req.logprobs is None:
            return None
        lp = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
        for e in entries:
            token = self._token(e["token_id"])
            lp.tokens.append(token)
            lp.token_logprobs.append(float(e["logprob"]))
            lp.top_logprobs.append({self._token(i): float(v) for i, v in e["top"][: self.req.logprobs]})
            lp.text_offset.append(offset)
            offset += len(token)
        return lp

    def response(self, states: list[ChoiceState], usage: Usage) -> CompletionResponse:
        choices = [
            CompletionChoice(
                index=s.index,
                text=s.text,
                logprobs=self._logprobs(s.logprobs, 0),
                finish_reason=s.finish_reason,
                molora=self._routed(s.token_ids, s.adapters, s),
            )
            for s in states
        ]
        return CompletionResponse(id=self.id, created=self.created, model=self.req.model, choices=choices, usage=usage)

    def chunk(self, state: ChoiceState, out: Any) -> CompletionChunk | None:
        wants_tokens = self.routing or self.req.logprobs is not None
        if not (out.new_text or out.finished or (out.new_token_ids and wants_tokens)):
            return None
        offset = len(state.text) - len(out.new_text)
        choice = CompletionChoice(
            index=state.index,
            text=out.new_text,
            logprobs=self._logprobs(out.logprobs or [], offset),
            finish_reason=out.finish_reason if out.finished else None,
            molora=self._routed(out.new_token_ids, out.token_adapters, state if out.finished else None),
        )
        return CompletionChunk(id=self.id, created=self.created, model=self.req.model, choices=[choice])

    def usage_chunk(self, usage: Usage) -> CompletionChunk:
        return CompletionChunk(id=self.id, created=self.created, model=self.req.model, choices=[], usage=usage)


class ChatFormat(ResponseFormat):
    tools: Any = None  # molora.server.tools.ToolCalls: the answers may hold tool calls (None: plain text)

    def _logprobs(self, entries: list[dict]) -> ChatLogprobs | None:
        if not self.req.logprobs:
            return None
        k = self.req.top_logprobs or 0
        content = []
        for e in entries:
            token = self._token(e["token_id"])
            top = [
                TopLogprob(token=(t := self._token(i)), logprob=float(v), bytes=list(t.encode()))
                for i, v in e["top"][:k]
            ]
            content.append(
                TokenLogprob(token=token, logprob=float(e["logprob"]), bytes=list(token.encode()), top_logprobs=top)
            )
        return ChatLogprobs(content=content)

    def response(self, states: list[ChoiceState], usage: Usage) -> ChatCompletionResponse:
        choices = [
            ChatChoice(
                index=s.index,
                message=ChatMessageOut(content=s.text) if self.tools is None else self.tools.message(s),
                logprobs=self._logprobs(s.logprobs),
                finish_reason=s.finish_reason if self.tools is None else self.tools.finish_reason(s),
                molora=self._routed(s.token_ids, s.adapters, s),
            )
            for s in states
        ]
        return ChatCompletionResponse(
            id=self.id, created=self.created, model=self.req.model, choices=choices, usage=usage
        )

    def head(self, state: ChoiceState) -> ChatCompletionChunk:
        choice = ChatChunkChoice(index=state.index, delta=Delta(role="assistant", content=""))
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.req.model, choices=[choice])

    def chunk(self, state: ChoiceState, out: Any) -> ChatCompletionChunk | None:
        wants_tokens = out.new_token_ids and (self.routing or self.req.logprobs)
        if not (out.new_text or out.finished or wants_tokens):
            return None
        # with tools, text that may be a call is held until the choice ends (molora.server.tools.ToolCalls.delta)
        delta = Delta(content=out.new_text or None) if self.tools is None else self.tools.delta(state, out.finished)
        if delta.content is None and delta.tool_calls is None and not (out.finished or wants_tokens):
            return None
        finish = None if not out.finished else self.tools.finish_reason(state) if self.tools else out.finish_reason
        choice = ChatChunkChoice(
            index=state.index,
            delta=delta,
            logprobs=self._logprobs(out.logprobs or []),
            finish_reason=finish,
            molora=self._routed(out.new_token_ids, out.token_adapters, state if out.finished else None),
        )
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.req.model, choices=[choice])

    def usage_chunk(self, usage: Usage) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.req.model, choices=[], usage=usage)
