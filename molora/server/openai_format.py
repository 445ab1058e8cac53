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
    PromptLogprob,
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
    prompt_ids: list[int] = field(default_factory=list)  # what an echo or prompt_logprobs writes out
    prompt_logprobs: list[dict | None] | None = None  # the engine's RequestOutput.prompt_logprobs, once given
    echoed: bool = False  # a stream has sent the echoed prompt
    chosen: dict | None = None  # the per-request chooser's pick for its prompt (RequestOutput.chosen), once given
    tenant: str | None = None  # whose request it is (molora.server.tenants), for the per-tenant metrics
    gaps: list[float] = field(default_factory=list)  # seconds between its outputs with tokens (inter-token times)

    def update(self, out: Any, now: float) -> None:
        self.prompt_tokens = out.prompt_tokens
        scores = getattr(out, "prompt_logprobs", None)
        if scores is not None:
            self.prompt_logprobs = scores
        self.cached_tokens = getattr(out, "cached_tokens", 0)
        self.text += out.new_text
        self.token_ids += out.new_token_ids
        self.adapters += out.token_adapters
        self.logprobs += out.logprobs or []
        if getattr(out, "chosen", None) is not None:
            self.chosen = out.chosen
        if out.new_token_ids:
            if self.t_last is not None:
                self.gaps.append(now - self.t_last)
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
        self.chooser: str | None = None  # the kind of per-request chooser that picks this request's adapter, if one

    def _routed(
        self, token_ids: list[int], adapters: list[str | None], ended: ChoiceState | None = None
    ) -> Routed | None:
        """The choice's molora extension: its routing (return_routing) and, once it has `ended`, why its answer
        breaks the request's structured-output spec (GrammarConstraint.check), if it does, and what the per-request
        chooser picked for its prompt, if one did."""
        why = None
        if ended is not None and ended.finish_reason == "stop" and self.constraint is not None:
            why = self.constraint.check(ended.text)
        chosen = None
        if ended is not None and ended.chosen is not None and self.chooser is not None:
            chosen = {"kind": self.chooser, **ended.chosen}
        if not self.routing and why is None and chosen is None:
            return None
        routed: dict[str, Any] = {"token_ids": list(token_ids), "adapters": list(adapters)} if self.routing else {}
        return Routed(**routed, structured_output_error=why, chooser=chosen)

    def _token(self, token_id: int) -> str:
        return self.info.tokenizer.decode([token_id])

    def _prompt_logprobs(self, state: ChoiceState) -> list[dict[int, PromptLogprob] | None] | None:
        """vLLM's prompt_logprobs of a choice: per prompt token None for the first, else {token id: entry} of the
        token itself (its rank) and its top n alternatives (ranks 1..n); None when not asked for."""
        n = getattr(self.req, "prompt_logprobs", None)
        if n is None:
            return None
        out: list[dict[int, PromptLogprob] | None] = []
        for tid, e in zip(state.prompt_ids, state.prompt_logprobs or [None] * len(state.prompt_ids)):
            if e is None:
                out.append(None)
                continue
            entry = {tid: PromptLogprob(logprob=float(e["logprob"]), rank=e["rank"], decoded_token=self._token(tid))}
            for r, (i, v) in enumerate(e["top"][:n]):
                entry.setdefault(i, PromptLogprob(logprob=float(v), rank=r + 1, decoded_token=self._token(i)))
            out.append(entry)
        return out

    def head(self, state: ChoiceState) -> BaseModel | None:
        return None

    def response(self, states: list[ChoiceState], usage: Usage) -> BaseModel:
        raise NotImplementedError

    def chunk(self, state: ChoiceState, out: Any) -> BaseModel | None:
        raise NotImplementedError

    def usage_chunk(self, usage: Usage) -> BaseModel:
        raise NotImplementedError


class CompletionFormat(ResponseFormat):
    """echo=true: a choice's text and logprobs start with its prompt (the text sent, or the decoded ids), whose
    first token has no logprob (null, as OpenAI and vLLM write it); a stream sends it in the choice's first chunk.
    The prompt's text offsets count from 0 by token, the completion's from the end of the prompt text."""

    def __init__(self, info: ModelInfo, id: str, req: Any) -> None:
        super().__init__(info, id, req)
        self._heads: dict[int, str] = {}  # prompt index -> the text echo writes for it

    def _logprobs(self, entries: list[dict], offset: int, echo: ChoiceState | None = None) -> CompletionLogprobs | None:
        if self.req.logprobs is None:
            return None
        lp = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
        if echo is not None:  # the prompt's tokens lead; each lists itself among its top too, as vLLM's do
            at = 0
            for tid, e in zip(echo.prompt_ids, echo.prompt_logprobs or [None] * len(echo.prompt_ids)):
                token = self._token(tid)
                self._add(lp, token, e, at, own=True)
                at += len(token)
        for e in entries:
            token = self._token(e["token_id"])
            self._add(lp, token, e, offset)
            offset += len(token)
        return lp

    def _add(self, lp: CompletionLogprobs, token: str, e: dict | None, offset: int, own: bool = False) -> None:
        lp.tokens.append(token)
        lp.token_logprobs.append(None if e is None else float(e["logprob"]))
        top = None if e is None else {self._token(i): float(v) for i, v in e["top"][: self.req.logprobs]}
        if own and top is not None and e is not None:
            top.setdefault(token, float(e["logprob"]))
        lp.top_logprobs.append(top)
        lp.text_offset.append(offset)

    def _prompt_text(self, state: ChoiceState) -> str:
        """What echo writes of the choice's prompt: the text sent, or its token ids decoded (once per prompt)."""
        p = state.index // self.req.n
        if p not in self._heads:
            prompt = self.req.prompt_list()[p]
            self._heads[p] = prompt if isinstance(prompt, str) else self.info.tokenizer.decode(prompt)
        return self._heads[p]

    def response(self, states: list[ChoiceState], usage: Usage) -> CompletionResponse:
        echo = bool(self.req.echo)
        choices = [
            CompletionChoice(
                index=s.index,
                text=(head := self._prompt_text(s) if echo else "") + s.text,
                logprobs=self._logprobs(s.logprobs, len(head), s if echo else None),
                finish_reason=s.finish_reason,
                prompt_logprobs=self._prompt_logprobs(s),
                molora=self._routed(s.token_ids, s.adapters, s),
            )
            for s in states
        ]
        return CompletionResponse(id=self.id, created=self.created, model=self.req.model, choices=choices, usage=usage)

    def chunk(self, state: ChoiceState, out: Any) -> CompletionChunk | None:
        wants_tokens = self.routing or self.req.logprobs is not None
        echo = bool(self.req.echo) and not state.echoed  # this chunk leads with the prompt
        if not (echo or out.new_text or out.finished or (out.new_token_ids and wants_tokens)):
            return None
        state.echoed = state.echoed or echo
        head = self._prompt_text(state) if self.req.echo else ""
        offset = len(head) + len(state.text) - len(out.new_text)
        choice = CompletionChoice(
            index=state.index,
            text=(head if echo else "") + out.new_text,
            logprobs=self._logprobs(out.logprobs or [], offset, state if echo else None),
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
            id=self.id,
            created=self.created,
            model=self.req.model,
            choices=choices,
            usage=usage,
            prompt_logprobs=self._prompt_logprobs(states[0]) if states else None,  # one prompt for every choice
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
