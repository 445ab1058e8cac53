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

The engine is composed of parts it owns, each in a module beside this file: `scheduler` (molora.engine.scheduler:
what runs this step), `hotset` (molora.engine.hotset: adapter slots and tiers), `allocator` and `prefix`
(molora.engine.kv, molora.engine.prefix: KV blocks and the prefix cache), `lifecycle` (molora.engine.lifecycle:
the requests in flight, the stop rules on each new token, deadlines, abort, and the freeing that ends a request),
`isolation` (molora.engine.faults: a step that raises is bisected to the requests that make it raise; corrupt
slots mend), `adapters` (molora.engine.runtime_adapters: read, register, list and unload adapters at run time;
`load_adapter` & co. here are its front door). Functions it calls: molora.engine.admission resolves a new request's
routing (once, before anything is queued), molora.engine.routing plans a step's routing, molora.engine.sampler
picks every sampled row's next id (constraints, min_tokens, logprobs), molora.engine.offline runs a list of
prompts to completion (`generate`).

Prompt scoring (SamplingParams.prompt_logprobs, what an echo of the prompt with logprobs needs): the runner returns
the logits of every prompt position of such a request too (`_scored_rows`, `ModelRunner.forward(token_logits=)`), each
under the routing its chunk runs on (pinned, token-id router, learned router per block, base), so chunked prefill
scores a prompt chunk by chunk; the entries land in `Request.prompt_scores` and go out once, on the request's first
output after its whole prompt is computed (RequestOutput.prompt_logprobs). Such a request takes no prefix-cache hits
(molora.engine.prefix). max_new_tokens 0 ends a request once its prompt is computed (finish_reason "length").

Speculative decoding (EngineConfig.speculative, vLLM's --speculative-config; molora.engine.speculative): before the
step the `speculator` gives each decoding request a draft from its own tokens (`_draft`); the scheduler runs it as a
chunk of 1 + k ids; the runner returns every row's logits and slots (`_verified_rows`, token_logits, token_slot_ids);
`_commit_draft` keeps the ids plain decoding would give, each with its own row's adapter, and rolls back the rest.

Faults and time: a request may carry deadlines (`add_request(timeout_s=, queue_timeout_s=)`), checked at the start
of every step: it ends with finish_reason "timeout" and `RequestOutput.error` saying which. A step that raises is
run again in halves until the request(s) that make it raise are found; only they end (finish_reason "error"), see
`step` and molora.engine.faults. `events` reports queue waits, deadline expiries and faults to a server.

The engine is single-threaded: a server drives `step()` from one thread and calls `add_request` /
`abort` under its own lock. Precision follows the model: fp32 by default (exact against transformers);
`mm.to(torch.bfloat16)` before building the engine runs weights, adapters and KV cache in bf16 (AMX on
this CPU: see molora/bench/engine.py for the measured gain). Owns requests and their lifecycle; knows
nothing about HTTP.
"""

from __future__ import annotations

import itertools
import logging
import math
import random
import time
from collections import deque
from collections.abc import Generator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from molora.adapters.io import LoRAAdapter
from molora.config import SamplingParams
from molora.engine.admission import ROUTING_CHOICES, RoutingRequest, chooser_stages, resolve_routing, run_chooser
from molora.engine.choosing import ChooserQueue
from molora.engine.faults import CorruptSlots, FaultIsolation
from molora.engine.hotset import HotSet
from molora.engine.kv import BlockAllocator
from molora.engine.lifecycle import RequestLifecycle
from molora.engine.offline import generate
from molora.engine.policy import POLICIES
from molora.engine.prefix import PrefixCache
from molora.engine.request import IncrementalDetokenizer, Request, RequestOutput, TextState
from molora.engine.routing import (
    RouteState,
    assumed_carry,
    plan_routing,
    record_carry,
    record_carry_rows,
    record_probe,
)
from molora.engine.runtime_adapters import AdapterManager
from molora.engine.sampler import sample_step, score_tokens, step_logprobs
from molora.engine.scheduler import ADMISSION, Scheduled, Scheduler
from molora.engine.speculative import SpeculativeConfig, Speculator, accept, carry_valid, merge_outputs
from molora.errors import MoLoRAError, RoutingError
from molora.model.batch import BatchMeta
from molora.model.graphs import DEFAULT_BUCKETS
from molora.model.runner import ModelRunner
from molora.ops.device import to_device
from molora.routing.mix import MixBook, check_expert_names, check_scale
from molora.sampling import Constraint, bundle_constraint, constraint_bitmask

if TYPE_CHECKING:
    from molora.model.attach import MoLoRAModel

log = logging.getLogger("molora.engine")

__all__ = ["ROUTING_CHOICES", "CorruptSlots", "Engine", "EngineConfig"]


@dataclass(frozen=True)
class EngineConfig:
    """Capacity of the engine. The KV cache holds `num_kv_blocks` blocks of `block_size` tokens (default:
    kv_budget_tokens / block_size); it must fit at least one sequence of max_model_len tokens."""

    max_num_seqs: int = 64
    max_tokens_per_step: int = 512  # tokens one step computes at most: decodes first, then prefill chunks
    max_num_batched_tokens: int | None = None  # vLLM's name for that budget: given, it replaces max_tokens_per_step
    enable_chunked_prefill: bool = True  # split a prompt across steps (vLLM's name); off: a prompt runs whole
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_budget_tokens: int = 32768
    max_model_len: int = 2048
    cpu_tier_bytes: int = 1 << 30
    stop_at_eos: bool = True  # finish a request at the model's eos token(s)
    seed: int = 0  # seeds the generators of sampled requests that give no seed
    enforce_eager: bool = False  # on CUDA, never replay decode steps from CUDA graphs (vLLM's name)
    pack_weights: bool | None = None  # base GEMMs on packed weights (molora.ops.packed; None: where they run)
    enable_prefix_caching: bool = True  # reuse full KV blocks of equal prefixes run on the same adapters (vLLM's name)
    admission: str = "fcfs"  # "slots": warm requests pass a slot-blocked one (molora.engine.scheduler)
    scheduling_policy: str = "fcfs"  # "priority" (vLLM's) or "fair" (per-tenant token counters): molora.engine.policy
    # the largest |weight| of an adapter in a request's mix or a pinned adapter's scale (molora.routing.mix): a plain
    # bound on how far a request may push a delta (2: twice the trained delta, or its negation), not a measured one
    max_mix_weight: float = 2.0
    # vLLM's --speculative-config (method "ngram" or "suffix"; molora.engine.speculative); None: off
    speculative: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        if self.speculative is not None and not isinstance(self.speculative, SpeculativeConfig):
            raise MoLoRAError(
                f"EngineConfig.speculative={self.speculative!r}: give a SpeculativeConfig "
                "(SpeculativeConfig.parse reads vLLM's JSON) or None"
            )
        if self.admission not in ADMISSION:
            raise MoLoRAError(f"EngineConfig.admission={self.admission!r}: choose one of {', '.join(ADMISSION)}")
        if self.scheduling_policy not in POLICIES:
            raise MoLoRAError(
                f"EngineConfig.scheduling_policy={self.scheduling_policy!r}: choose one of {', '.join(POLICIES)}"
            )
        for name in ("max_num_seqs", "max_tokens_per_step", "block_size", "kv_budget_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise MoLoRAError(f"EngineConfig.{name}={getattr(self, name)} must be at least 1")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise MoLoRAError(f"EngineConfig.max_num_batched_tokens={self.max_num_batched_tokens} must be at least 1")
        if not self.enable_chunked_prefill and self.token_budget < self.max_model_len:
            raise MoLoRAError(
                f"with enable_chunked_prefill=False a whole prompt must fit one step, but the step budget "
                f"(max_num_batched_tokens) {self.token_budget} is smaller than max_model_len={self.max_model_len}; "
                "raise it, lower max_model_len or enable chunked prefill"
            )
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise MoLoRAError(f"EngineConfig.num_kv_blocks={self.num_kv_blocks} must be at least 1")
        if self.cpu_tier_bytes < 0:
            raise MoLoRAError(f"EngineConfig.cpu_tier_bytes={self.cpu_tier_bytes} must be >= 0")
        if not (math.isfinite(self.max_mix_weight) and self.max_mix_weight > 0):
            raise MoLoRAError(f"EngineConfig.max_mix_weight={self.max_mix_weight} must be a positive finite number")

    @property
    def token_budget(self) -> int:
        """Tokens one step computes at most (max_num_batched_tokens if given, else max_tokens_per_step)."""
        return self.max_num_batched_tokens if self.max_num_batched_tokens is not None else self.max_tokens_per_step

    @property
    def kv_blocks(self) -> int:
        return self.num_kv_blocks if self.num_kv_blocks is not None else -(-self.kv_budget_tokens // self.block_size)


class Engine:
    """Serves requests over one `MoLoRAModel` (module docstring)."""

    def __init__(self, mm: MoLoRAModel, config: EngineConfig = EngineConfig(), *, tokenizer: Any = None) -> None:
        self.mm, self.config = mm, config
        self.tokenizer = tokenizer if tokenizer is not None else mm.tokenizer
        mcfg = mm.config
        self.max_model_len = min(config.max_model_len, getattr(mcfg, "max_position_embeddings", None) or 1 << 30)
        if config.kv_blocks * config.block_size < self.max_model_len:
            raise MoLoRAError(
                f"the KV cache ({config.kv_blocks} blocks x {config.block_size} tokens) cannot hold one "
                f"sequence of max_model_len={self.max_model_len}; raise kv_budget_tokens or lower "
                "max_model_len"
            )
        self.runner = ModelRunner(
            mm,
            num_blocks=config.kv_blocks,
            block_size=config.block_size,
            max_model_len=self.max_model_len,
            pack_weights=config.pack_weights,
        )
        if self.runner.device.type == "cuda" and not config.enforce_eager:
            # decode steps replayed from CUDA graphs, captured per batch bucket on first use (molora.model.graphs)
            try:  # k up to the slots: a static mix is top-k over its adapters (molora.engine.routing)
                self.runner.enable_graphs(
                    buckets=[b for b in DEFAULT_BUCKETS if b < config.max_num_seqs] + [config.max_num_seqs],
                    max_top_k=mm.bank.num_slots,
                )
            except MoLoRAError as e:
                log.warning("decode steps run eagerly: %s", e)
        self.hotset = HotSet(mm, config.cpu_tier_bytes)
        self.mixes = MixBook()  # named mixes (add_mix; a bundle's molora.json "mixes")
        self.router_experts: list[str] = []  # named mixes the router takes as experts (set_router_experts)
        for name, adapters in (getattr(getattr(mm, "bundle", None), "mixes", None) or {}).items():
            self.add_mix(name, adapters)
        self.set_router_experts(getattr(getattr(mm, "bundle", None), "router_experts", None) or [])
        self.allocator = BlockAllocator(config.kv_blocks, config.block_size)
        self.prefix = (
            PrefixCache(self.allocator, self.hotset, ("model", id(mm), str(self.runner.cache.k.dtype)))
            if config.enable_prefix_caching
            else None
        )
        self.scheduler = Scheduler(
            self.allocator,
            self.hotset,
            max_num_seqs=config.max_num_seqs,
            max_tokens_per_step=config.token_budget,
            prefix=self.prefix,
            admission=config.admission,
            chunked_prefill=config.enable_chunked_prefill,
            policy=config.scheduling_policy,
        )
        self.vocab_size = int(mcfg.vocab_size)
        self._mask_pool: ThreadPoolExecutor | None = None  # fills constraint masks while a step computes
        eos = getattr(getattr(mm.model, "generation_config", None), "eos_token_id", None)
        eos = eos if eos is not None else getattr(mcfg, "eos_token_id", None)
        eos_ids = frozenset([eos] if isinstance(eos, int) else eos or []) if config.stop_at_eos else frozenset()
        # what happened, for a server's metrics: ("queue_wait", s), ("deadline", "request" | "queue"),
        # ("fault", message), ("isolated", message); the consumer pops from the left, the oldest drop off
        self.events: deque[tuple[str, Any]] = deque(maxlen=10000)
        self.lifecycle = RequestLifecycle(self.scheduler, eos_ids, self.max_model_len, self.events)
        self.requests = self.lifecycle.requests  # the requests in flight, by id (the lifecycle's table)
        self.isolation = FaultIsolation(
            mm, self.hotset, self.allocator, self.prefix, self.runner.cache, self.lifecycle, self.events
        )
        self.adapters = AdapterManager(self.hotset, self.scheduler, self.abort)
        self.choosing = ChooserQueue(
            mm,
            self.hotset,
            admit=self._admit_chosen,
            end=self.lifecycle.end,
            busy=self.scheduler.has_work,
            events=self.events,
        )
        self._suspects: list[str] = []  # adapters that gave non-finite logits this step (_quarantine)
        self.speculator = Speculator(config.speculative) if config.speculative is not None else None
        self._ids = itertools.count()
        self._rng = random.Random(config.seed)
        self.steps = self.tokens_computed = 0
        # the bundle's constrained spans (an early-fusion model's image spans), applied in `sample_step`; None: none
        self.constraint = bundle_constraint(getattr(mm, "bundle", None), self.tokenizer)
        log.info(
            "engine: %d KV blocks x %d tokens (%.1f MiB), %d slots, max_model_len %d",
            config.kv_blocks,
            config.block_size,
            self.runner.cache.nbytes() / 2**20,
            mm.bank.num_slots,
            self.max_model_len,
        )

    # ------------------------------------------------------------------------------------ requests
    def add_request(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        request_id: str | None = None,
        adapter: str | None = None,
        allowed_adapters: list[str] | None = None,
        routing: str = "auto",
        timeout_s: float | None = None,
        queue_timeout_s: float | None = None,
        constraint: Constraint | None = None,
        question: str | None = None,
        tenant: str | None = None,
        priority: int = 0,
        mix: Mapping[str, float] | str | None = None,
        scale: float | None = None,
    ) -> str:
        """Queue a request; returns its id. Bad input raises a MoLoRAError and changes nothing.

        tenant: whose request it is, the unit of the fair share (EngineConfig.scheduling_policy "fair"; None: the
        adapter it is pinned to, else "default"); priority: lower goes first under the "priority" policy (vLLM's).

        mix: every token on the weighted sum of these adapters' deltas, {adapter: weight} or a named mix (`add_mix`);
        weights within +-EngineConfig.max_mix_weight, at most as many adapters as slots (molora.routing.mix).
        scale: the pinned `adapter`'s weight (its delta times scale), within the same bound. Both are rows of slot ids
        and weights to the dispatch, batched with every other request; a refusal is a RoutingError naming the field.

        constraint: what its generated ids must obey (e.g. molora.structured.GrammarConstraint, compiled off this
        thread), on top of the bundle's constrained spans; a step where nothing is allowed ends the request with
        finish_reason "error" (molora.engine.sampler). Routing is unaffected: the mask depends on the ids only.

        routing "hybrid": the model's per-request chooser picks the one adapter (or the base model) the request runs
        on, from `question` (None: the prompt, decoded); the request waits for the pick (molora.engine.choosing),
        which its first output reports (RequestOutput.chosen).

        timeout_s: the request ends with finish_reason "timeout" once it has been in the engine this long;
        queue_timeout_s: the same if it has not started (been scheduled) by then. Both are checked at the start
        of every step, so they fire at the first step boundary past the deadline; KV blocks and pins are freed.
        """
        for name, value in (("timeout_s", timeout_s), ("queue_timeout_s", queue_timeout_s)):
            if value is not None and not value > 0:
                raise MoLoRAError(f"{name}={value} must be a positive number of seconds (or None: no limit)")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise MoLoRAError(f"priority={priority!r} must be an integer (lower goes first)")
        if priority and self.config.scheduling_policy != "priority":
            raise MoLoRAError(
                f"priority={priority} needs the priority scheduling policy (EngineConfig.scheduling_policy='priority',"
                f" molora serve --scheduling-policy priority); this engine runs {self.config.scheduling_policy!r}: "
                "leave priority 0"
            )
        if tenant is not None and (not isinstance(tenant, str) or not tenant):
            raise MoLoRAError(f"tenant={tenant!r} must be a non-empty string (or None: the adapter, else 'default')")
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise MoLoRAError("the prompt is empty; give at least one token id")
        if len(prompt) > self.max_model_len:
            raise MoLoRAError(
                f"the prompt has {len(prompt)} tokens, more than max_model_len={self.max_model_len}; "
                "shorten it or raise EngineConfig.max_model_len"
            )
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise MoLoRAError(f"token ids {bad[:5]} lie outside the vocabulary [0, {self.vocab_size})")
        knob_ids = [*params.logit_bias, *(t for word in params.bad_words_ids for t in word)]
        bad = [t for t in knob_ids if t >= self.vocab_size]
        if bad:
            raise MoLoRAError(
                f"logit_bias / bad_words_ids name token ids {bad[:5]} outside the vocabulary [0, {self.vocab_size})"
            )
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self.requests:
            raise MoLoRAError(f"request id {rid!r} is already in flight; use a unique id")
        if params.stop and self.tokenizer is None:
            raise MoLoRAError("stop strings need a tokenizer; pass one to Engine(..., tokenizer=...)")
        bound, slots = self.config.max_mix_weight, self.mm.bank.num_slots
        pairs = None if mix is None else self.mixes.resolve(mix, self.hotset.paths, bound, slots)
        weight = None if scale is None else check_scale(scale, bound)
        ask = RoutingRequest(routing, adapter, allowed_adapters, question, pairs, weight)
        mode, router, allowed, needs = resolve_routing(
            ask, self.hotset, self.mm.router, self.mm.bank.num_slots, self.mm.chooser
        )
        gen = None
        if not params.greedy:
            seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
            gen = torch.Generator(device=self.runner.device).manual_seed(seed)
        detok = IncrementalDetokenizer(self.tokenizer, prompt) if self.tokenizer is not None else None
        route = RouteState(
            mode,
            len(prompt),
            router,
            adapter if mode == "pinned" else None,
            allowed,
            needs,
            mix=pairs,
            scale=None if weight == 1.0 else weight,  # a scale of 1 is the plain pinned request (shares its KV)
            prompt_routes=[] if mode == "learned" and getattr(router, "probe_prompt", False) else None,
        )
        req = Request(rid, prompt, params, route, generator=gen, detok=detok, text=TextState(tuple(params.stop)))
        req.arrival = time.monotonic()
        req.tenant = tenant if tenant is not None else adapter if adapter is not None else "default"
        req.priority = priority
        req.timeout_s, req.queue_timeout_s = timeout_s, queue_timeout_s
        req.constraints = [c.begin(prompt) for c in (self.constraint, constraint) if c is not None]
        if mode == "choosing":
            if question is None:
                if self.tokenizer is None:
                    raise MoLoRAError("routing='hybrid' reads the prompt as text: pass question= or a tokenizer")
                question = self.tokenizer.decode(prompt, skip_special_tokens=True)
            req.question = question
            self.requests[rid] = req
            self.choosing.add(req)
        else:
            self.lifecycle.admit(req)
        return rid

    def _admit_chosen(self, req: Request, pick: str | None) -> None:
        """Queue a request the chooser picked `pick` for (None: the base model), pinned to it. A pick that can no
        longer run (unloaded meanwhile) ends the request with an error naming it."""
        ask = RoutingRequest("auto" if pick is not None else "none", pick, req.route.allowed)
        try:
            mode, router, allowed, needs = resolve_routing(ask, self.hotset, self.mm.router, self.mm.bank.num_slots)
        except MoLoRAError as e:
            self.lifecycle.pending.append(self.lifecycle.end(req, "error", f"the chooser's pick cannot run: {e}"))
            return
        req.route = RouteState(mode, len(req.prompt_ids), router, pick if mode == "pinned" else None, allowed, needs)
        self.scheduler.add(req)

    @property
    def eos_ids(self) -> frozenset[int]:
        """The ids that end a request (the model's eos; none with stop_at_eos=False): the lifecycle's stop rule."""
        return self.lifecycle.eos_ids

    @eos_ids.setter
    def eos_ids(self, ids: frozenset[int]) -> None:
        self.lifecycle.eos_ids = frozenset(ids)

    def abort(self, request_id: str, error: str | None = None) -> None:
        """Cancel a request: its KV blocks and pins are freed now; the next step reports it finished ("abort",
        with `error` as RequestOutput.error when given). Unknown or already finished ids are ignored."""
        self.lifecycle.abort(request_id, error)

    def has_unfinished(self) -> bool:
        return self.lifecycle.has_unfinished()

    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams], **kw: Any
    ) -> list[RequestOutput]:
        """Run `prompts` to completion; one aggregated output per prompt, in order (molora.engine.offline.generate:
        keyword arguments go to add_request, per prompt as lists where they may be)."""
        return generate(self, prompts, params, **kw)

    # ------------------------------------------------------------------------------------ one step
    @torch.no_grad()
    def step(self) -> list[RequestOutput]:
        """Run one scheduler step; outputs of requests that produced tokens or finished.

        Failure isolation: when computing the step raises, its chunks are run again in halves until the
        request(s) that make it raise are found; only those end (finish_reason "error", RequestOutput.error
        names the cause), the rest of the step completes as if nothing happened (recomputing a chunk writes
        the same KV rows again; sampler generators are restored first). A request whose logits are not
        finite also ends alone. Non-finite hidden states with non-finite adapter weights in the bank (memory
        corruption after validation: the stacked dispatch spreads one bad slot to every row) make the engine
        rewrite those slots from a fresh read of their folders and run the step again; an adapter that cannot
        be read again is zeroed and only the requests that may use it end. The scheduler, KV pool and pins
        are checked after every recovered fault. An exception that escapes step() is an engine bug.
        """
        outputs = self.lifecycle.take_pending()
        now = time.monotonic()
        outputs += self.lifecycle.expire(now)
        if len(self.choosing):
            outputs += self.choosing.step(lambda r: r.request_id in self.requests)
        if self.speculator is not None:
            self._draft()
        scheduled = self.scheduler.schedule()
        outputs += self.lifecycle.drop_refused()
        if not scheduled:
            if self.scheduler.waiting and not self.scheduler.running and not self.hotset.reads and not self.choosing:
                head = self.scheduler.waiting[0]  # a bookkeeping bug, but this request's alone: end it
                why = (
                    f"request {head.request_id!r} cannot be admitted on an idle engine "
                    f"({self.allocator.num_free} free KV blocks, adapters {list(head.needs)})"
                )
                log.error("%s; ending it", why)
                outputs.append(self.isolation.fail(head, why))
            return outputs
        self.steps += 1
        for s in scheduled:
            if not s.request.started:
                s.request.started = True
                self.events.append(("queue_wait", now - s.request.arrival))
        faults = self.isolation.faults
        outputs += self.isolation.run(self._run, scheduled)
        if self._suspects:
            self._quarantine()
        if self.isolation.faults != faults:
            self.check()  # a recovered fault must leave the scheduler, KV pool and pins consistent
        return outputs

    def _draft(self) -> None:
        """Give every decoding request its draft for this step (molora.engine.speculative), within what its
        max_new_tokens and max_model_len leave after the next id; the scheduler takes as many as the budget allows.
        None while more than `Speculator.max_decodes` requests decode (speculative.MAX_DECODES: where verification
        was measured not to pay)."""
        assert self.speculator is not None
        decoding = [r for r in self.scheduler.running if r.remaining == 1]
        busy = len(decoding) > self.speculator.max_decodes  # measured: verification stops paying there
        for req in self.scheduler.running:
            req.draft = []
            if req.remaining == 1 and not busy:
                room = min(req.params.max_new_tokens - req.num_generated, self.max_model_len - len(req.tokens)) - 1
                req.draft = self.speculator.propose(req, room)

    def _quarantine(self) -> None:
        """Unload (force) each adapter whose finite weights still gave a request non-finite logits on its own (the
        only adapter on the request's last token): every later request on it would fail the same way. Its other
        requests end with an error naming it; the event ("quarantined", name) reaches the server's metrics."""
        names, self._suspects = sorted(set(self._suspects)), []
        for name in names:
            if name not in self.hotset.paths:
                continue
            try:
                self.unload_adapter(name, force=True)
                log.error("adapter %r gave non-finite logits with finite weights; quarantined (unloaded)", name)
            except MoLoRAError as e:  # a fixed token router still names it: it stays, adding nothing
                self.mm.bank.rewrite(name, None)
                self.hotset.forget_warm(name)
                self.hotset.forget_version(name)
                if self.prefix is not None:
                    self.prefix.invalidate()
                log.error("adapter %r gave non-finite logits with finite weights; zeroed in its slot (%s)", name, e)
            self.events.append(("quarantined", name))

    def _run(self, scheduled: list[Scheduled]) -> list[RequestOutput]:
        """Compute one group of chunks (may raise: nothing but KV rows and generators changed yet), then commit
        each request's results on its own (an error there ends that request only)."""
        tokens, positions, meta = self._inputs(scheduled)
        routing = plan_routing(scheduled, self.hotset, self.runner.device)
        # a request of max_new_tokens 0 samples nothing: it ends once its prompt is computed; a drafted chunk's rows
        # come back as token_logits after the prompt rows scored (`verify`: chunk index -> its span there)
        rows = [
            i for i, s in enumerate(scheduled) if s.samples and s.request.params.max_new_tokens > 0 and not s.drafted
        ]
        scored, targets, spans = self._scored_rows(scheduled)
        verify, vrows = self._verified_rows(scheduled, len(scored))
        masks = self._fill_masks([scheduled[i].request for i in rows])  # while the step computes
        try:
            out = self.runner(
                tokens, positions, meta, routing, logits=rows, token_logits=(scored + vrows) or None
            )  # StepOutput, logits [b, V], token_logits [t, V]
        finally:
            bitmask = masks.result() if masks is not None else None  # [c, W] of constrained rows
        last_slots, last_carry, carry_rows = out.last_slot_ids, out.last_carry, out.carry_rows
        # host reads of the step, batched (each is a device sync on a GPU): 1) whether the hidden states and each
        # sampled row's logits are finite (one reduction each: NaN and inf survive a sum), 2) the sampled ids with
        # the slot of each sequence's last token
        ok = torch.isfinite(out.hidden.sum()).reshape(1)
        logits = out.logits  # [b, V], the rows asked for
        if rows:
            assert logits is not None, "the runner returned no logits for the rows asked for"
            rows_ok = torch.isfinite(logits.sum(-1))
        flags = (ok if not rows else torch.cat([ok, rows_ok])).tolist()
        if not flags[0]:
            corrupt = self.mm.bank.nonfinite()
            if corrupt:
                raise CorruptSlots(corrupt)
        finite: list[bool] = []
        picked: list[int] = []
        dead: dict[int, str] = {}
        logprobs: list[list[dict] | None] = []
        if rows:
            assert logits is not None
            finite = flags[1:]  # [b]
            reqs = [scheduled[i].request for i in rows]
            chosen, dead = sample_step(reqs, logits, finite, self.eos_ids, bitmask)  # [b]
            logprobs = step_logprobs(reqs, logits, chosen)
            picked = (chosen if last_slots is None else torch.cat([chosen, last_slots[:, 0]])).tolist()
        scores: list[dict] = []
        if scored:
            assert out.token_logits is not None, "the runner returned no logits for the prompt rows asked for"
            top = max(scheduled[i].request.params.prompt_logprobs or 0 for i in spans)
            scores = score_tokens(out.token_logits, to_device(targets, out.token_logits.device), top)
        self.tokens_computed += len(tokens)
        # ---- commit, request by request
        outputs: list[RequestOutput] = []
        table = self.mm.bank.table
        sampled = {i: j for j, i in enumerate(rows)}
        offset = 0
        for i, s in enumerate(scheduled):
            req, off = s.request, offset
            offset += s.n
            j = sampled.get(i)
            if j is not None and not finite[j]:
                used = sorted({table[x] for x in (last_slots[i].tolist() if last_slots is not None else []) if x >= 0})
                if len(used) == 1:
                    self._suspects.append(used[0])
                outputs.append(
                    self.isolation.fail(
                        req,
                        f"the model produced non-finite logits for this request (adapters "
                        f"on its last token: {used or 'none'}); a corrupt adapter?",
                    )
                )
                continue
            if j in dead:  # its constraint allows no next id: it ends alone, the step goes on
                req.num_computed += s.n
                outputs.append(self.lifecycle.end(req, "error", dead[j]))
                continue
            try:
                if s.drafted:
                    outputs.append(self._commit_draft(s, off, out, verify[i]))
                    continue
                if routing is not None and routing.carry is not None and last_carry is not None:
                    record_carry([s], last_carry[i : i + 1])
                if s.probe:  # a probe chunk; its prompt is computed again once the probe ends
                    assert carry_rows is not None, "a probe chunk's step returned no router decisions"
                    ended = record_probe([s], carry_rows[off : off + s.n])[0]
                    req.num_computed = s.start + s.n
                    if ended:
                        self.scheduler.restart(req)
                else:
                    req.num_computed += s.n
                if i in spans and req.prompt_scores is not None:  # prompt positions p predict tokens p + 1
                    a, b = spans[i]
                    n = req.params.prompt_logprobs or 0
                    for k, e in enumerate(scores[a:b]):
                        req.prompt_scores[s.start + 1 + k] = {**e, "top": e["top"][:n]}
                if self.prefix is not None:
                    self.prefix.publish(req)  # before _advance, which may free the table
                if j is not None:
                    slot = -1 if last_slots is None else picked[len(rows) + i]
                    adapter = table[slot] if slot >= 0 else None
                    outputs.append(self.lifecycle.advance(req, picked[j], adapter, logprobs[j]))
                    if self.speculator is not None and outputs[-1].finished:
                        self.speculator.finished(req)
                elif s.samples and req.params.max_new_tokens == 0:
                    outputs.append(self.lifecycle.end(req, "length"))  # its prompt is computed (and scored): done
            except Exception as e:
                log.error(
                    "request %s failed alone while committing its step: %s: %s",
                    req.request_id,
                    type(e).__name__,
                    e,
                    exc_info=True,
                )
                self.isolation.faults += 1
                outputs.append(self.isolation.fail(req, f"the engine failed on this request ({type(e).__name__}: {e})"))
        return outputs

    def check(self) -> None:
        """Assert the engine's bookkeeping: scheduler queues, KV pool and adapter pins agree with the requests."""
        self.scheduler.check()
        queued = {r.request_id for r in self.scheduler.waiting} | {r.request_id for r in self.scheduler.running}
        queued |= {r.request_id for r in self.choosing.requests()}
        assert queued == set(self.requests), (sorted(queued ^ set(self.requests)), "requests and queues disagree")

    @staticmethod
    def _scored_rows(scheduled: list[Scheduled]) -> tuple[list[int], list[int], dict[int, tuple[int, int]]]:
        """The rows of the step whose logits score a prompt (SamplingParams.prompt_logprobs): (rows in T, the
        prompt token each row predicts, {chunk index: its span in those rows}). A chunk's positions p < P - 1
        predict prompt token p + 1 under the routing the chunk runs on; a probe chunk scores nothing (its prompt
        is computed again with the probe's decisions)."""
        rows: list[int] = []
        targets: list[int] = []
        spans: dict[int, tuple[int, int]] = {}
        offset = 0
        for i, s in enumerate(scheduled):
            req = s.request
            end = min(s.start + s.n, len(req.prompt_ids) - 1)  # the last prompt position predicts no prompt token
            if req.params.prompt_logprobs is not None and not s.probe and s.start < end:
                spans[i] = (len(rows), len(rows) + end - s.start)
                rows += range(offset, offset + end - s.start)
                targets += req.prompt_ids[s.start + 1 : end + 1]
            offset += s.n
        return rows, targets, spans

    @staticmethod
    def _verified_rows(scheduled: list[Scheduled], first: int) -> tuple[dict[int, tuple[int, int]], list[int]]:
        """The rows of the drafted chunks (speculative verification): ({chunk index: its span among the token_logits
        rows, counted from `first`}, the rows in T), every row of each such chunk."""
        spans: dict[int, tuple[int, int]] = {}
        rows: list[int] = []
        offset = 0
        for i, s in enumerate(scheduled):
            if s.drafted:
                spans[i] = (first + len(rows), first + len(rows) + s.n)
                rows += range(offset, offset + s.n)
            offset += s.n
        return spans, rows

    def _commit_draft(self, s: Scheduled, off: int, out: Any, span: tuple[int, int]) -> RequestOutput:
        """Commit a drafted chunk (molora.engine.speculative): accept the ids plain decoding would give from the rows
        whose carried decision was right (`_accept_draft`), append them one by one through the stop rules
        (publishing each full block as plain decoding does), then roll back the rest: the request's computed length
        stops after the last kept row and the KV blocks past it go back to the pool."""
        assert self.speculator is not None and out.token_logits is not None
        req = s.request
        a, b = span
        logits = out.token_logits[a:b]  # [n, V]: row j predicts the id after chunk token j
        slots = out.token_slot_ids[a:b, 0].tolist() if out.token_slot_ids is not None else [-1] * s.n
        assumed, computed = assumed_carry(s), None
        if assumed is not None and out.carry_rows is not None:
            computed = out.carry_rows[off : off + s.n].tolist()  # [n] each row's decision at carry_source
        got = self._accept_draft(s, logits, slots, assumed, computed)
        if got is None:
            return self.isolation.fail(
                req, "the model produced non-finite logits for this request (a verified draft); a corrupt adapter?"
            )
        emitted, rows, slots = got
        e = len(emitted)
        lps: list[list[dict] | None] = [None] * e
        if req.params.logprobs:
            lps = step_logprobs([req] * e, rows, to_device(emitted, rows.device))
        table = self.mm.bank.table
        pieces = []
        for j, tok in enumerate(emitted):
            req.num_computed = s.start + j + 1
            if self.prefix is not None:
                self.prefix.publish(req)  # before advance, which may free the table
            pieces.append(self.lifecycle.advance(req, tok, table[slots[j]] if slots[j] >= 0 else None, lps[j]))
            if pieces[-1].finished:
                self.speculator.finished(req)
                break
        req.draft = []
        if not pieces[-1].finished:
            self.allocator.truncate(req.block_table, req.num_computed)
        return merge_outputs(pieces)

    def _accept_draft(
        self,
        s: Scheduled,
        logits: torch.Tensor,
        slots: list[int],
        assumed: list[int] | None,
        computed: list[int] | None,
    ) -> tuple[list[int], torch.Tensor, list[int]] | None:
        """The ids a drafted chunk emits, the logits rows [e, V] and slots [e] they came from (None: a row's logits
        were not finite), its kept rows' carry_source decisions recorded. Rows up to the first whose assumed carry
        was wrong (`carry_valid`; all of them without carry) are verified; the rest are dropped (carry "truncate")
        or, when the draft id of that first wrong row is accepted, computed again from it on with the decisions
        this pass gave (carry "rerun": that row's carry is then the one plain decoding gives, the next rows assume
        this pass's decisions), until a pass's rows all carried right or a draft id is rejected."""
        assert self.speculator is not None
        req = s.request
        draft = req.draft[: s.drafted]  # draft[i]: the id at chunk row i + 1, verified by row i's logits
        rerun = self.speculator.config.carry == "rerun"
        pos, emitted, used, kept = 0, [], [], []  # pos: the chunk row the current pass starts at
        reruns = rerun_rows = 0
        while True:
            if not bool(torch.isfinite(logits.sum())):
                return None
            n = s.n - pos
            m = n if computed is None or assumed is None else carry_valid(assumed, computed)
            rest = draft[pos:]
            last = m == n or not rerun
            got = accept(logits[:m], rest[: m - 1] if last else rest[:m], req.params, req.generator)  # [<= m]
            if computed is not None:
                record_carry_rows(Scheduled(req, s.start + pos, n), computed[: len(got)])
            emitted += got
            used.append(logits[: len(got)])
            kept += slots[: len(got)]
            if last or got != rest[:m]:
                cut = n - m if last else 0
                accepted = sum(1 for x, d in zip(emitted, draft) if x == d)
                self.speculator.record(len(draft), len(emitted), accepted, cut, reruns, rerun_rows)
                return emitted, torch.cat(used), kept
            assert computed is not None
            pos += m
            assumed = computed[m - 1 : n - 1]  # row pos's carry is exact now; the rest assume this pass's decisions
            logits, slots, computed = self._rerun(Scheduled(req, s.start + pos, n - m, drafted=n - m), assumed)
            reruns += 1
            rerun_rows += n - m

    def _rerun(self, s: Scheduled, carries: list[int]) -> tuple[torch.Tensor, list[int], list[int]]:
        """Compute the rows of `s` (the tail of a drafted chunk, its KV rows already allocated) again, each carrying
        carries[j] (speculative carry "rerun"): (logits [n, V], slots [n], carry_source decisions [n])."""
        tokens, positions, meta = self._inputs([s])
        routing = plan_routing([s], self.hotset, self.runner.device)
        assert routing is not None and routing.carry is not None, "a carry rerun without a carrying router"
        routing = replace(routing, carry=to_device(carries, self.runner.device))
        out = self.runner(tokens, positions, meta, routing, token_logits=list(range(s.n)))
        self.tokens_computed += s.n
        assert out.token_logits is not None and out.carry_rows is not None
        slots = out.token_slot_ids[:, 0].tolist() if out.token_slot_ids is not None else [-1] * s.n
        return out.token_logits, slots, out.carry_rows.tolist()

    def _inputs(self, scheduled: list[Scheduled]) -> tuple[torch.Tensor, torch.Tensor, BatchMeta]:
        toks: list[int] = []
        pos: list[int] = []
        for s in scheduled:
            toks += s.ids
            pos += range(s.start, s.start + s.n)
        meta = BatchMeta(
            [s.n for s in scheduled], [s.start + s.n for s in scheduled], [s.request.block_table for s in scheduled]
        )
        dev = self.runner.device
        return to_device(toks, dev), to_device(pos, dev), meta

    def close(self) -> None:
        """Stop the adapter loader thread (HotSet.close) and the mask filler; the engine still works, a later miss
        or constrained step restarts them."""
        self.hotset.close()
        if self._mask_pool is not None:
            self._mask_pool.shutdown()
            self._mask_pool = None

    def _fill_masks(self, reqs: list[Request]) -> Future | None:
        """The packed bitmask [c, W] of the constrained ones among `reqs` (their ids so far), filled on a worker
        thread while the step's forward runs (the grammar engine releases the GIL); None: none is constrained."""
        cons = [r for r in reqs if r.constraints]
        if not cons:
            return None
        if self._mask_pool is None:
            self._mask_pool = ThreadPoolExecutor(1, thread_name_prefix="molora-masks")
        V = self.vocab_size
        return self._mask_pool.submit(constraint_bitmask, [r.constraints for r in cons], [r.tokens for r in cons], V)

    def reset(self, why: str) -> list[RequestOutput]:
        """End every request in flight with finish_reason "error" and `why` (after an engine bug); their
        outputs are returned. The KV cache rows are zeroed."""
        outs = [self.lifecycle.end(req, "error", why) for req in list(self.requests.values())]
        self.choosing.discard()
        if self.prefix is not None:
            self.prefix.invalidate()
        self.runner.cache.clear_blocks(range(self.allocator.num_blocks))
        return outs

    def choose(self, questions: list[str], allowed: list[str] | None = None) -> list[dict]:
        """The per-request chooser's pick for each question text (molora.engine.admission.run_chooser); between
        steps, on the engine thread. The caller then adds each request pinned to its pick (None: the base)."""
        return run_chooser(self.mm, self.hotset, questions, allowed, self.scheduler.has_work)

    def choose_stages(
        self, questions: list[str], allowed: list[str] | None = None
    ) -> Generator[None, None, list[dict]]:
        """`choose` in stages of one forward pass (molora.engine.admission.chooser_stages): advance it on the engine
        thread, one stage between two steps, and close it if the caller gives up (its adapters stay pinned till
        then). With no request running or waiting, a stage runs every pass still to come in one forward."""
        return chooser_stages(self.mm, self.hotset, questions, allowed, self.scheduler.has_work)

    # ------------------------------------------------------------------------------------ adapters
    def add_mix(self, name: str, adapters: Mapping[str, float], router_expert: bool | None = None) -> None:
        """Register (or replace) a named mix that requests may give as `mix=name` (molora.routing.mix.MixBook.add:
        a RoutingError naming the field, nothing changed, for a name that is an adapter's or a bad mix).

        router_expert True: the model's router takes the mix as one of its experts too (`set_router_experts`), False:
        no longer, None: as before (a replaced expert mix keeps its place, with its new weights)."""
        old = dict(self.mixes.items()).get(name)
        self.mixes.add(name, adapters, self.hotset.paths, self.config.max_mix_weight, self.mm.bank.num_slots)
        experts = [n for n in self.router_experts if n != name or router_expert is not False]
        if router_expert and name not in experts:
            experts.append(name)
        if experts == self.router_experts and name not in experts:
            return
        try:
            self.set_router_experts(experts)
        except MoLoRAError:
            if old is None:
                self.mixes.remove(name)
            else:
                self.mixes.add(name, dict(old), self.hotset.paths, self.config.max_mix_weight, self.mm.bank.num_slots)
            raise

    def set_router_experts(self, names: Sequence[str]) -> None:
        """Make these named mixes experts of the model's in-network router (molora.json "router_experts"): a token the
        router sends to one runs on that mix's weighted sum of adapter deltas, the same row as a static mix
        (molora.routing.mix.router_experts; how each router takes a mix: LearnedRouter.set_mix_experts,
        ArrowRouter.set_mix_experts). [] restores plain routing. A RoutingError(field="router_experts") naming the mix,
        nothing changed, for an unknown mix, a model without an in-network router, or a mix the router cannot take
        (its adapters not all loaded or, for the learned router, not all its own). Requests in flight keep routing by
        the router's experts of each step; call it between requests to change what running ones run on."""
        names = check_expert_names(names, self.mixes)
        router = getattr(self.mm, "router", None)
        if names and not callable(getattr(router, "set_mix_experts", None)):
            raise RoutingError(
                f"router_experts {names} need an in-network router (learned or arrow); this model's router is "
                f"{type(router).__name__ if router is not None else 'none'}",
                field="router_experts",
            )
        pairs = {}
        for n in names:
            pairs[n] = self.mixes.resolve(n, self.hotset.paths, self.config.max_mix_weight, self.mm.bank.num_slots)
        set_experts = getattr(router, "set_mix_experts", None)
        if callable(set_experts) and (pairs or getattr(router, "mix_experts", None)):
            set_experts(pairs)
        self.router_experts = names

    # the front door to `self.adapters` (molora.engine.runtime_adapters.AdapterManager), in vLLM's engine terms
    def read_adapter(self, name: str, path: str | Path, *, roots: Sequence[str | Path] | None = None) -> LoRAAdapter:
        """Read and validate a PEFT folder on any thread (AdapterManager.read), for `load_adapter` afterwards."""
        return self.adapters.read(name, path, roots=roots)

    def load_adapter(
        self, name: str, source: str | Path | LoRAAdapter, *, roots: Sequence[str | Path] | None = None
    ) -> None:
        """Register an adapter at run time, a folder or a `read_adapter` result (AdapterManager.load)."""
        self._not_a_mix([name])
        self.adapters.load(name, source, roots=roots)

    def load_adapter_stages(
        self, name: str, source: str | Path | LoRAAdapter, *, roots: Sequence[str | Path] | None = None
    ) -> Generator[None, None, None]:
        """`load_adapter` in stages for the engine thread, one between two steps (AdapterManager.load_stages)."""
        self._not_a_mix([name])
        return self.adapters.load_stages(name, source, roots=roots)

    def register_adapters(
        self, folders: Mapping[str, str | Path], *, roots: Sequence[str | Path] | None = None
    ) -> None:
        """Make folders known by name, weights read on first use (AdapterManager.register)."""
        self._not_a_mix(list(folders))
        self.adapters.register(folders, roots=roots)

    def _not_a_mix(self, names: Sequence[str]) -> None:
        clash = sorted(n for n in names if n in self.mixes)
        if clash:
            raise MoLoRAError(f"adapter name(s) {clash} are named mixes' (Engine.add_mix); choose other names")

    def unload_adapter(self, name: str, force: bool = False) -> str:
        """ "unloaded" or "draining" (AdapterManager.unload); force=True aborts the requests that use it."""
        return self.adapters.unload(name, force)

    def list_adapters(self) -> list[dict]:
        """Every adapter's name, path, slot, tier, pins and state (AdapterManager.describe)."""
        return self.adapters.describe()

    # ------------------------------------------------------------------------------------ stats
    def stats(self) -> dict:
        """Counters and the current state, read at every /metrics scrape (cheap: one pass over the requests).

        `lora_requests` is what an inference gateway routes on (vLLM's `lora_requests_info`): the adapters the
        running and the waiting requests route to, each sorted, and `max_lora`, the bank's slots (the most
        adapters resident at once). A request's adapters are its pins (`Request.needs`): a pinned request's
        one adapter; a per-token request's every adapter its router may choose within its allowed set (at most
        the slots; all of them resident while it runs). A base-model request names none."""
        sched, g = self.scheduler, self.runner.graphs
        lora = {
            "running": sorted({n for r in sched.running for n in r.needs}),
            "waiting": sorted({n for r in sched.waiting for n in r.needs}),
            "max_lora": self.mm.bank.num_slots,
        }
        return {
            "num_waiting": len(sched.waiting) + len(self.choosing),
            "num_running": len(sched.running),
            "kv_blocks_total": self.allocator.num_blocks,
            "kv_blocks_free": self.allocator.num_free,
            "hotset": self.hotset.stats(),
            "tokens_by_adapter": dict(self.lifecycle.tokens_by_adapter),
            "tokens_generated": self.lifecycle.tokens_generated,
            "tokens_computed": self.tokens_computed,
            "steps": self.steps,
            "num_preemptions": sched.num_preemptions,
            "num_seat_preemptions": sched.num_seat_preemptions,
            "faults": self.isolation.faults,
            "failed_requests": self.isolation.failures,
            "deadlines_expired": dict(self.lifecycle.deadlines_expired),
            "lora_requests": lora,
            "decode_graphs": None
            if g is None
            else {"captured": g.captures, "replays": g.replays, "failed": len(g.failed)},
            "prefix_cache": self.prefix.stats() if self.prefix is not None else {"enabled": False},
            "speculative": self.speculator.stats() if self.speculator is not None else {"enabled": False},
        }
