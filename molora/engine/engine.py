"""`Engine`: continuous batching with per-token adapter routing over one attached base model.

    engine = Engine(mm, EngineConfig(max_num_seqs=32))
    rid = engine.add_request(prompt_ids, SamplingParams(max_new_tokens=64), adapter="math")
    while engine.has_unfinished():
        for out in engine.step():            # RequestOutput deltas: new ids, new text, adapters, finished
            ...
    engine.generate([ids_a, ids_b], SamplingParams())   # offline: run to completion, one output each

One step: the scheduler picks prefill chunks and one decode token per running request under the token
budget, KV blocks and hot-set slots -> one flattened batch (tokens [T], positions [T], block tables) ->
`plan_routing` gives every token its slots (pinned, token-id router, learned router per block, or base)
-> `ModelRunner` forward -> logits of the sequences that reached their last known token -> sampler ->
stop checks and streaming detokenization -> outputs. Finished and aborted requests free their KV blocks
and adapter pins at once.

The engine is single-threaded: a server drives `step()` from one thread and calls `add_request` /
`abort` under its own lock. Precision follows the model: fp32 by default (exact against transformers);
`mm.to(torch.bfloat16)` before building the engine runs weights, adapters and KV cache in bf16 (AMX on
this CPU: see molora/bench/engine.py for the measured gain). Owns requests and their lifecycle; knows
nothing about HTTP.
"""

from __future__ import annotations

import itertools
import logging
import random
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch

from molora.config import SamplingParams
from molora.engine.hotset import HotSet
from molora.engine.kv import BlockAllocator
from molora.engine.request import IncrementalDetokenizer, Request, RequestOutput, TextState
from molora.engine.routing import plan_routing, record_carry, record_probe
from molora.engine.scheduler import Scheduled, Scheduler
from molora.errors import AdapterError, MoLoRAError, RoutingError
from molora.model.runner import BatchMeta, ModelRunner
from molora.routing import SequenceRouter, VocabRouter
from molora.sampling import sample_next, top_logprobs

log = logging.getLogger("molora.engine")

ROUTING_CHOICES = ("auto", "learned", "vocab", "sequence", "none")


@dataclass(frozen=True)
class EngineConfig:
    """Capacity of the engine. The KV cache holds `num_kv_blocks` blocks of `block_size` tokens (default:
    kv_budget_tokens / block_size); it must fit at least one sequence of max_model_len tokens."""

    max_num_seqs: int = 64
    max_tokens_per_step: int = 512
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_budget_tokens: int = 32768
    max_model_len: int = 2048
    cpu_tier_bytes: int = 1 << 30
    stop_at_eos: bool = True           # finish a request at the model's eos token(s)
    seed: int = 0                      # seeds the generators of sampled requests that give no seed

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_tokens_per_step", "block_size", "kv_budget_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise MoLoRAError(f"EngineConfig.{name}={getattr(self, name)} must be at least 1")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise MoLoRAError(f"EngineConfig.num_kv_blocks={self.num_kv_blocks} must be at least 1")
        if self.cpu_tier_bytes < 0:
            raise MoLoRAError(f"EngineConfig.cpu_tier_bytes={self.cpu_tier_bytes} must be >= 0")

    @property
    def kv_blocks(self) -> int:
        return self.num_kv_blocks if self.num_kv_blocks is not None else -(-self.kv_budget_tokens // self.block_size)


class Engine:
    """Serves requests over one `MoLoRAModel` (module docstring)."""

    def __init__(self, mm: Any, config: EngineConfig = EngineConfig(), *, tokenizer: Any = None) -> None:
        self.mm, self.config = mm, config
        self.tokenizer = tokenizer if tokenizer is not None else mm.tokenizer
        mcfg = mm.model.config
        self.max_model_len = min(config.max_model_len, getattr(mcfg, "max_position_embeddings", None) or 1 << 30)
        if config.kv_blocks * config.block_size < self.max_model_len:
            raise MoLoRAError(f"the KV cache ({config.kv_blocks} blocks x {config.block_size} tokens) cannot hold one "
                              f"sequence of max_model_len={self.max_model_len}; raise kv_budget_tokens or lower "
                              "max_model_len")
        self.runner = ModelRunner(mm, num_blocks=config.kv_blocks, block_size=config.block_size,
                                  max_model_len=self.max_model_len)
        self.hotset = HotSet(mm, config.cpu_tier_bytes)
        self.allocator = BlockAllocator(config.kv_blocks, config.block_size)
        self.scheduler = Scheduler(self.allocator, self.hotset, max_num_seqs=config.max_num_seqs,
                                   max_tokens_per_step=config.max_tokens_per_step)
        self.vocab_size = int(mcfg.vocab_size)
        eos = getattr(getattr(mm.model, "generation_config", None), "eos_token_id", None)
        eos = eos if eos is not None else getattr(mcfg, "eos_token_id", None)
        self.eos_ids = frozenset([eos] if isinstance(eos, int) else eos or []) if config.stop_at_eos else frozenset()
        self.requests: dict[str, Request] = {}
        self._pending: list[RequestOutput] = []
        self._ids = itertools.count()
        self._rng = random.Random(config.seed)
        self.steps = self.tokens_generated = self.tokens_computed = 0
        self.tokens_by_adapter: Counter[str] = Counter()
        log.info("engine: %d KV blocks x %d tokens (%.1f MiB), %d slots, max_model_len %d", config.kv_blocks,
                 config.block_size, self.runner.cache.nbytes() / 2**20, mm.bank.num_slots, self.max_model_len)

    # ------------------------------------------------------------------------------------ requests
    def add_request(self, prompt_ids: list[int], params: SamplingParams, *, request_id: str | None = None,
                    adapter: str | None = None, allowed_adapters: list[str] | None = None,
                    routing: str = "auto") -> str:
        """Queue a request; returns its id. Bad input raises a MoLoRAError and changes nothing."""
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise MoLoRAError("the prompt is empty; give at least one token id")
        if len(prompt) > self.max_model_len:
            raise MoLoRAError(f"the prompt has {len(prompt)} tokens, more than max_model_len={self.max_model_len}; "
                              "shorten it or raise EngineConfig.max_model_len")
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise MoLoRAError(f"token ids {bad[:5]} lie outside the vocabulary [0, {self.vocab_size})")
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self.requests:
            raise MoLoRAError(f"request id {rid!r} is already in flight; use a unique id")
        if params.stop and self.tokenizer is None:
            raise MoLoRAError("stop strings need a tokenizer; pass one to Engine(..., tokenizer=...)")
        mode, router, allowed, needs = self._resolve_routing(routing, adapter, allowed_adapters)
        gen = None
        if not params.greedy:
            seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
            gen = torch.Generator(device=self.runner.device).manual_seed(seed)
        detok = IncrementalDetokenizer(self.tokenizer, prompt) if self.tokenizer is not None else None
        req = Request(rid, prompt, params, mode, adapter if mode == "pinned" else None, allowed, needs,
                      router=router, generator=gen, detok=detok, text=TextState(tuple(params.stop)),
                      prompt_routes=[] if mode == "learned" and getattr(router, "probe_prompt", False) else None)
        self.requests[rid] = req
        self.scheduler.add(req)
        return rid

    def _resolve_routing(self, routing: str, adapter: str | None, allowed_adapters: list[str] | None
                         ) -> tuple[str, Any, frozenset[str] | None, tuple[str, ...]]:
        """(mode, router, allowed, adapters to pin) for a request; see molora.engine.routing."""
        if routing not in ROUTING_CHOICES:
            raise RoutingError(f"routing={routing!r}; choose one of {ROUTING_CHOICES}")
        hs = self.hotset
        hs.check_known([adapter] if adapter is not None else [])
        allowed = None if allowed_adapters is None else frozenset(allowed_adapters)
        hs.check_known(sorted(allowed or ()))
        router = self.mm.router
        if routing == "none" or (routing == "auto" and adapter is None and router is None):
            if adapter is not None:
                raise RoutingError(f"routing='none' runs the base model; drop adapter={adapter!r}")
            return "none", None, allowed, ()
        if adapter is not None or routing == "sequence":
            if adapter is None:
                raise RoutingError("routing='sequence' pins one adapter per request: pass adapter=<name>")
            if routing not in ("auto", "sequence"):
                raise RoutingError(f"adapter={adapter!r} pins the request, which contradicts routing={routing!r}")
            if allowed is not None and adapter not in allowed:
                raise RoutingError(f"adapter {adapter!r} is not among allowed_adapters {sorted(allowed)}")
            return "pinned", None, allowed, (adapter,)
        if router is None:
            raise RoutingError(f"routing={routing!r} needs a router, but the model has none attached")
        if routing == "learned" and not router.in_network:
            raise RoutingError(f"routing='learned' needs an in-network router; the model has {type(router).__name__}")
        if routing == "vocab" and not isinstance(router, VocabRouter):
            raise RoutingError(f"routing='vocab' needs a VocabRouter; the model has {type(router).__name__}")
        if router.in_network:
            names = [n for n in router.adapter_names if n in hs.paths]
            mode = "learned"
        else:
            if isinstance(router, VocabRouter):
                names = [n for n in dict.fromkeys([r[2] for r in router.ranges] + [router.default]) if n is not None]
                hs.check_known(names)
            elif isinstance(router, SequenceRouter) and isinstance(router.adapters, str):
                names = [router.adapters]
                hs.check_known(names)
            else:
                names = hs.names
            mode = "tokens"
        needs = tuple(n for n in names if allowed is None or n in allowed)
        if len(needs) > self.mm.bank.num_slots:
            raise RoutingError(f"this request may route to {len(needs)} adapters {list(needs)}, but the bank has "
                               f"{self.mm.bank.num_slots} slots; restrict allowed_adapters or attach with more slots")
        return mode, router, allowed, needs

    def abort(self, request_id: str) -> None:
        """Cancel a request: its KV blocks and pins are freed now; the next step reports it finished ("abort").
        Unknown or already finished ids are ignored."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return
        req.finish_reason = "abort"
        self.scheduler.finish(req)
        self._pending.append(req.output([], req.text.emit(final=True), [], None))

    def has_unfinished(self) -> bool:
        return bool(self.requests) or bool(self._pending)

    # ------------------------------------------------------------------------------------ one step
    @torch.no_grad()
    def step(self) -> list[RequestOutput]:
        """Run one scheduler step; outputs of requests that produced tokens or finished."""
        outputs, self._pending = self._pending, []
        scheduled = self.scheduler.schedule()
        for req, why in self.scheduler.failed:
            log.error("request %s aborted: %s", req.request_id, why)
            self.requests.pop(req.request_id, None)
            req.finish_reason = "abort"
            outputs.append(req.output([], "", [], None))
        self.scheduler.failed.clear()
        if not scheduled:
            if self.scheduler.waiting and not self.scheduler.running:
                head = self.scheduler.waiting[0]
                raise MoLoRAError(f"request {head.request_id!r} cannot be admitted on an idle engine "
                                  f"({self.allocator.num_free} free KV blocks, adapters {list(head.needs)})")
            return outputs
        self.steps += 1
        tokens, positions, meta = self._inputs(scheduled)
        routing = plan_routing(scheduled, self.hotset, self.runner.device)
        hidden = self.runner(tokens, positions, meta, routing)                    # [B, D]
        last_slots = self.runner.last_slot_ids                                    # [B, k] or None
        if routing is not None and routing.carry is not None:
            record_carry(scheduled, self.runner.last_carry)
        if any(s.probe for s in scheduled):
            record_probe(scheduled, self.runner.carry_rows)
        for s in scheduled:
            if not s.probe:
                s.request.num_computed += s.n
        self.tokens_computed += len(tokens)
        rows = [i for i, s in enumerate(scheduled) if s.samples]
        if not rows:
            return outputs
        logits = self.runner.logits(hidden[rows])                                 # [b, V]
        reqs = [scheduled[i].request for i in rows]
        chosen = self._sample(reqs, logits)
        table = self.mm.bank.table
        for j, (i, req) in enumerate(zip(rows, reqs)):
            slot = -1 if last_slots is None else int(last_slots[i, 0])
            adapter = table[slot] if slot >= 0 else None
            lp = self._logprobs(req, logits[j], chosen[j])
            outputs.append(self._advance(req, int(chosen[j]), adapter, lp))
        return outputs

    def _inputs(self, scheduled: list[Scheduled]) -> tuple[torch.Tensor, torch.Tensor, BatchMeta]:
        toks: list[int] = []
        pos: list[int] = []
        for s in scheduled:
            toks += s.request.tokens[s.start:s.start + s.n]
            pos += range(s.start, s.start + s.n)
        meta = BatchMeta([s.n for s in scheduled], [s.start + s.n for s in scheduled],
                         [s.request.block_table for s in scheduled])
        dev = self.runner.device
        return torch.tensor(toks, device=dev), torch.tensor(pos, device=dev), meta

    def _sample(self, reqs: list[Request], logits: torch.Tensor) -> torch.Tensor:
        chosen = logits.argmax(-1)                                                # [b] greedy for all
        for j, req in enumerate(reqs):
            p = req.params
            if not p.greedy:
                chosen[j] = sample_next(logits[j:j + 1], p.temperature, p.top_k, p.top_p, req.generator)[0]
        return chosen

    @staticmethod
    def _logprobs(req: Request, logits: torch.Tensor, chosen: torch.Tensor) -> list[dict] | None:
        n = req.params.logprobs
        if n <= 0:
            return None
        lp, vals, ids = top_logprobs(logits[None], chosen.reshape(1), n)
        top = [(int(i), float(v)) for i, v in zip(ids[0], vals[0])]
        return [{"token_id": int(chosen), "logprob": float(lp[0]), "top": top}]

    def _advance(self, req: Request, token: int, adapter: str | None, lp: list[dict] | None) -> RequestOutput:
        """Append a sampled token, apply stop rules, stream text; finish and free the request if done."""
        req.tokens.append(token)
        self.tokens_generated += 1
        self.tokens_by_adapter[adapter or "base"] += 1
        p = req.params
        reason, cut = None, False
        if token in self.eos_ids or token in p.stop_token_ids:
            reason = "stop"
        elif req.text.append(req.detok.add(token) if req.detok is not None else ""):
            reason, cut = "stop", True
        if reason is None and (req.num_generated >= p.max_new_tokens or len(req.tokens) >= self.max_model_len):
            reason = "length"
        if reason is not None and not cut and req.detok is not None:
            if req.text.append(req.detok.flush()):  # bytes held back at the end may complete a stop string
                reason = "stop"
        text = req.text.emit(final=reason is not None)
        if reason is not None:
            req.finish_reason = reason
            self.scheduler.finish(req)
            del self.requests[req.request_id]
        return req.output([token], text, [adapter], lp)

    # ------------------------------------------------------------------------------------ offline use
    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                 **kw: Any) -> list[RequestOutput]:
        """Run `prompts` to completion; one aggregated output per prompt, in order. Keyword arguments go to
        add_request; `adapter`, `routing` and `allowed_adapters` may also be given per prompt as lists.
        Outputs of other requests in flight are consumed by the steps taken here."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise MoLoRAError(f"{len(plist)} SamplingParams for {len(prompts)} prompts")
        ids: list[str] = []
        try:
            for i, (prompt, p) in enumerate(zip(prompts, plist)):
                ids.append(self.add_request(prompt, p, **{k: _per_prompt(k, v, i, len(prompts)) for k, v in kw.items()}))
        except MoLoRAError:
            for rid in ids:
                self.abort(rid)
            self._pending = [o for o in self._pending if o.request_id not in ids]
            raise
        agg = {rid: RequestOutput(rid, [], "", [], False, None, len(p), 0, None) for rid, p in zip(ids, prompts)}
        while not all(o.finished for o in agg.values()):
            for out in self.step():
                a = agg.get(out.request_id)
                if a is None:
                    continue
                a.new_token_ids += out.new_token_ids
                a.new_text += out.new_text
                a.token_adapters += out.token_adapters
                if out.logprobs is not None:
                    a.logprobs = (a.logprobs or []) + out.logprobs
                a.finished, a.finish_reason, a.completion_tokens = out.finished, out.finish_reason, out.completion_tokens
        return [agg[rid] for rid in ids]

    # ------------------------------------------------------------------------------------ adapters, stats
    def load_adapter(self, name: str, path: str) -> None:
        """Register a PEFT folder at run time (validated now; loaded into a free slot if there is one)."""
        self.hotset.register(name, path)

    def unload_adapter(self, name: str) -> None:
        """Forget an adapter; refused with an AdapterError while a running or queued request may use it."""
        users = [r.request_id for r in self.requests.values() if name in r.needs]
        if users:
            raise AdapterError(f"adapter {name!r} is in use by {len(users)} in-flight request(s) {users[:5]}; "
                               "abort them or wait for them to finish before unloading it")
        self.hotset.unregister(name)

    def list_adapters(self) -> list[dict]:
        """name, path, slot (or None), tier ("slot" | "cpu" | "disk") and pin count of every adapter."""
        return self.hotset.describe()

    def stats(self) -> dict:
        return {"num_waiting": len(self.scheduler.waiting), "num_running": len(self.scheduler.running),
                "kv_blocks_total": self.allocator.num_blocks, "kv_blocks_free": self.allocator.num_free,
                "hotset": self.hotset.stats(), "tokens_by_adapter": dict(self.tokens_by_adapter),
                "tokens_generated": self.tokens_generated, "tokens_computed": self.tokens_computed,
                "steps": self.steps, "num_preemptions": self.scheduler.num_preemptions}


def _per_prompt(key: str, value: Any, i: int, n: int) -> Any:
    """A generate() keyword's value for prompt i: lists of per-prompt values are indexed."""
    if key in ("adapter", "routing", "request_id") and isinstance(value, list):
        return value[i]
    if key == "allowed_adapters" and isinstance(value, list) and value and \
            all(v is None or isinstance(v, list) for v in value) and len(value) == n:
        return value[i]
    return value
