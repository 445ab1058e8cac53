"""Offline use of the engine: run a list of prompts to completion and aggregate each one's outputs.

`generate(engine, ...)` is what `Engine.generate` (molora.engine.engine) runs: it queues every prompt through
`add_request` (keyword arguments given once, or per prompt as lists), steps until all of them finished, and
folds each request's streamed deltas into one `RequestOutput`. A bad prompt refuses the whole call with nothing
left queued. It drives the public `add_request` / `step` / `abort` only; the step itself is the engine's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from molora.config import SamplingParams
from molora.engine.request import RequestOutput
from molora.errors import MoLoRAError

if TYPE_CHECKING:
    from molora.engine.engine import Engine


def generate(
    engine: Engine, prompts: list[list[int]], params: SamplingParams | list[SamplingParams], **kw: Any
) -> list[RequestOutput]:
    """Run `prompts` to completion; one aggregated output per prompt, in order. Keyword arguments go to
    add_request; `adapter`, `routing`, `constraint`, `question` and `allowed_adapters` may also be given per prompt as
    lists.
    Outputs of other requests in flight are consumed by the steps taken here."""
    plist = params if isinstance(params, list) else [params] * len(prompts)
    if len(plist) != len(prompts):
        raise MoLoRAError(f"{len(plist)} SamplingParams for {len(prompts)} prompts")
    ids: list[str] = []
    try:
        for i, (prompt, p) in enumerate(zip(prompts, plist)):
            ids.append(engine.add_request(prompt, p, **{k: _per_prompt(k, v, i, len(prompts)) for k, v in kw.items()}))
    except MoLoRAError:
        engine.lifecycle.withdraw(ids)
        raise
    agg = {rid: RequestOutput(rid, [], "", [], False, None, len(p), 0, None) for rid, p in zip(ids, prompts)}
    while not all(o.finished for o in agg.values()):
        for out in engine.step():
            a = agg.get(out.request_id)
            if a is None:
                continue
            a.new_token_ids += out.new_token_ids
            a.new_text += out.new_text
            a.token_adapters += out.token_adapters
            if out.logprobs is not None:
                a.logprobs = (a.logprobs or []) + out.logprobs
            a.finished, a.finish_reason, a.completion_tokens = (
                out.finished,
                out.finish_reason,
                out.completion_tokens,
            )
            a.cached_tokens = out.cached_tokens
            if out.prompt_logprobs is not None:  # given once (SamplingParams.prompt_logprobs)
                a.prompt_logprobs = out.prompt_logprobs
            a.error = out.error if out.error is not None else a.error
            a.chosen = out.chosen if out.chosen is not None else a.chosen
    return [agg[rid] for rid in ids]


def _per_prompt(key: str, value: Any, i: int, n: int) -> Any:
    """A generate() keyword's value for prompt i: lists of per-prompt values are indexed."""
    per_prompt = ("adapter", "routing", "request_id", "constraint", "question", "tenant", "priority", "mix", "scale")
    if key in per_prompt and isinstance(value, list):
        return value[i]
    if (
        key == "allowed_adapters"
        and isinstance(value, list)
        and value
        and all(v is None or isinstance(v, list) for v in value)
        and len(value) == n
    ):
        return value[i]
    return value
