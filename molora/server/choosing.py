"""The per-request chooser in front of the generation endpoints (`molora serve ... --router hybrid`).

A request to the base name (`model=<served name>`) with `molora.routing` "auto" asks the engine's chooser
(`EngineClient.choose` -> `Engine.choose`, molora.routing.hybrid) which adapter each of its prompts goes to: the
chat's last user turn, or each completion prompt (token ids decoded). Each prompt's requests then run pinned to
that adapter, or on the base model. A request that pins an adapter (`model=NAME`) or sets `molora.routing` to
another mode never asks it; `molora.adapters` limits what it may pick. The pick is reported per choice under
`molora.chooser` (molora.server.protocol.Chosen) and counted in /metrics (`molora_chooser_choices_total`).

The chooser follows adapters loaded and unloaded at run time (molora.engine.runtime_adapters: recalibrated and
swapped in between engine steps; a choice in flight finishes on the chooser it began with).

A chooser that fails on one request answers that request alone: 503 with Retry-After when its adapters cannot be
put in slots now (`BankFullError`), else 500 naming the cause and the ways around it; the server goes on serving.
Knows nothing of engines (an `EngineClient` runs the chooser) nor of the wire format of responses.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from molora.errors import BankFullError
from molora.server.catalog import ModelInfo
from molora.server.client import EngineClient
from molora.server.metrics import ServerMetrics
from molora.server.protocol import APIError, ChatCompletionRequest, GenerationRequest
from molora.server.runner import EngineBusy, RunnerStopped, Saturated


def applies(info: ModelInfo, adapter: str | None, req: GenerationRequest) -> bool:
    """The chooser decides this request: the bundle has one, no adapter is pinned, routing is left to the server
    or asks for it by name ("hybrid"; a server without a chooser refuses that: `molora.server.generation`)."""
    return info.chooser is not None and adapter is None and req.options.routing in ("auto", "hybrid")


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


async def choose(
    client: EngineClient,
    metrics: ServerMetrics,
    info: ModelInfo,
    questions: Sequence[str],
    allowed: list[str] | None,
) -> list[dict]:
    """The chooser's {"kind", "adapter", "share", "z"} per question; APIError for this request alone on a failure."""
    t0 = time.perf_counter()
    try:
        picks = await client.choose(info.name, list(questions), allowed)
    except (EngineBusy, RunnerStopped, Saturated):
        raise  # the server's own state: the guards answer 503 / 429 as for any request
    except BankFullError as e:
        metrics.count_choice_failure()
        raise APIError(503, str(e), type="server_error", code="chooser_busy", headers={"Retry-After": "1"}) from e
    except Exception as e:  # a fault inside the chooser ends this request, not the server
        metrics.count_choice_failure()
        raise APIError(
            500,
            f"the adapter chooser failed on this request ({type(e).__name__}: {e}); name an adapter as the model, "
            "or set molora.routing, to run without it",
            type="server_error",
            code="chooser_error",
        ) from e
    metrics.observe_choices([p["adapter"] for p in picks], time.perf_counter() - t0)
    return [{"kind": info.chooser, **p} for p in picks]
