"""Which requests the per-request chooser decides (`molora serve ... --router hybrid`), and the text it reads.

A request to the base name (`model=<served name>`) with `molora.routing` "auto" (or "hybrid") is routed "hybrid":
the engine's chooser (molora.engine.choosing) reads its question, the chat's last user turn or each completion
prompt (token ids decoded), and runs each prompt's requests pinned to the adapter it picks, or on the base model.
A request that pins an adapter (`model=NAME`) or sets `molora.routing` to another mode never asks it;
`molora.adapters` limits what it may pick. The pick is reported per choice under `molora.chooser`
(molora.server.protocol.Chosen) and counted in /metrics (`molora_chooser_choices_total`, from the engine's events).

The chooser follows adapters loaded and unloaded at run time (molora.engine.runtime_adapters: recalibrated and
swapped in between engine steps; a choice in flight finishes on the chooser it began with). A chooser that fails on
a request ends that request alone (500 `chooser_error`, molora.server.generation); the server goes on serving.
"""

from __future__ import annotations

from molora.server.catalog import ModelInfo
from molora.server.protocol import APIError, ChatCompletionRequest, GenerationRequest


def applies(info: ModelInfo, adapter: str | None, req: GenerationRequest) -> bool:
    """The chooser decides this request: the bundle has one, no adapter is pinned, routing is left to the server
    or asks for it by name ("hybrid"; a server without a chooser refuses that: `molora.server.generation`)."""
    return (
        info.chooser is not None
        and adapter is None
        and req.options.mix is None
        and req.options.routing in ("auto", "hybrid")
    )


def chat_question(req: ChatCompletionRequest) -> str:
    """The text the chooser reads for a chat: its last user turn."""
    for m in reversed(req.messages):
        if m.role == "user":
            return m.text()
    raise APIError(
        400,
        "this server picks an adapter from the last user message (--router hybrid), and the messages hold none; "
        "add one, or name an adapter as the model",
        param="messages",
    )


def completion_question(info: ModelInfo, prompt: str | list[int]) -> str:
    """The text the chooser reads for one completion prompt (token ids decoded)."""
    return prompt if isinstance(prompt, str) else info.tokenizer.decode(prompt, skip_special_tokens=True)
