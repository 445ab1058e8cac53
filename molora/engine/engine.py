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

Adapters at run time: a cold adapter is read and validated on the hot set's loader thread while the
steps go on (the step only copies a read adapter into a slot); `read_adapter` reads on any thread and
`load_adapter(name, adapter)` registers the result; `unload_adapter` drains an adapter that requests in
flight still use (new requests leave it out) or, with force=True, aborts them. See molora.engine.hotset.

Faults and time: a request may carry deadlines (`add_request(timeout_s=, queue_timeout_s=)`), checked at the
start of every step: it ends with finish_reason "timeout" and `RequestOutput.error` saying which. A step
that raises is run again in halves until the request(s) that make it raise are found; only they end
(finish_reason "error"), see `step`. `events` reports queue waits, deadline expiries and faults to a server.

The engine is single-threaded: a server drives `step()` from one thread and calls `add_request` /
`abort` under its own lock. Precision follows the model: fp32 by default (exact against transformers);
`mm.to(torch.bfloat16)` before building the engine runs weights, adapters and KV cache in bf16 (AMX on
this CPU: see molora/bench/engine.py for the measured gain). Owns requests and their lifecycle; knows
nothing about HTTP.
"""

from __future__ import annotations

import itertools
import logging
from concurrent.futures import Future, ThreadPoolExecutor
import random
import time
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from molora.adapters.io import LoRAAdapter
from molora.config import SamplingParams
from molora.engine.hotset import HotSet
from molora.engine.kv import BlockAllocator
from molora.engine.prefix import PrefixCache
from molora.engine.request import IncrementalDetokenizer, Request, RequestOutput, TextState
from molora.engine.routing import RouteState, plan_routing, record_carry, record_probe
from molora.engine.scheduler import Scheduled, Scheduler
from molora.errors import AdapterDraining, AdapterError, MoLoRAError, RoutingError
from molora.model.graphs import DEFAULT_BUCKETS
from molora.model.batch import BatchMeta
from molora.model.runner import ModelRunner
from molora.ops import fused_cpu
from molora.ops.device import to_device
from molora.routing import ArrowRouter, SequenceRouter, VocabRouter
from molora.sampling import (Constraint, apply_bitmask, bitmask_words, bundle_constraint, constraint_bitmask, greedy,
                             is_allowed, masked_greedy, sample_next, top_logprobs)

log = logging.getLogger("molora.engine")

ROUTING_CHOICES = ("auto", "learned", "arrow", "vocab", "sequence", "none")


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
    enforce_eager: bool = False        # on CUDA, never replay decode steps from CUDA graphs (vLLM's name)
    pack_weights: bool | None = None   # base GEMMs on packed weights (molora.ops.packed; None: where they run)
    enable_prefix_caching: bool = True  # reuse full KV blocks of equal prefixes run on the same adapters (vLLM's name)

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
                                  max_model_len=self.max_model_len, pack_weights=config.pack_weights)
        if self.runner.device.type == "cuda" and not config.enforce_eager:
            # decode steps replayed from CUDA graphs, captured per batch bucket on first use (molora.model.graphs)
            try:
                self.runner.enable_graphs(buckets=[b for b in DEFAULT_BUCKETS if b < config.max_num_seqs]
                                          + [config.max_num_seqs])
            except MoLoRAError as e:
                log.warning("decode steps run eagerly: %s", e)
        self.hotset = HotSet(mm, config.cpu_tier_bytes)
        self.allocator = BlockAllocator(config.kv_blocks, config.block_size)
        self.prefix = PrefixCache(self.allocator, self.hotset, ("model", id(mm), str(self.runner.cache.k.dtype))) \
            if config.enable_prefix_caching else None
        self.scheduler = Scheduler(self.allocator, self.hotset, max_num_seqs=config.max_num_seqs,
                                   max_tokens_per_step=config.max_tokens_per_step, prefix=self.prefix)
        self.vocab_size = int(mcfg.vocab_size)
        self._mask_pool: ThreadPoolExecutor | None = None   # fills constraint masks while a step computes
        eos = getattr(getattr(mm.model, "generation_config", None), "eos_token_id", None)
        eos = eos if eos is not None else getattr(mcfg, "eos_token_id", None)
        self.eos_ids = frozenset([eos] if isinstance(eos, int) else eos or []) if config.stop_at_eos else frozenset()
        self.requests: dict[str, Request] = {}
        self._pending: list[RequestOutput] = []
        self._ids = itertools.count()
        self._rng = random.Random(config.seed)
        self.steps = self.tokens_generated = self.tokens_computed = 0
        self.faults = self.failures = 0     # chunks that raised / requests ended alone by a fault (step())
        self.deadlines_expired: Counter[str] = Counter()
        # what happened, for a server's metrics: ("queue_wait", s), ("deadline", "request" | "queue"),
        # ("fault", message), ("isolated", message); the consumer pops from the left, the oldest drop off
        self.events: deque[tuple[str, Any]] = deque(maxlen=10000)
        self.tokens_by_adapter: Counter[str] = Counter()
        # the bundle's constrained spans (an early-fusion model's image spans), applied in `_sample`; None: none
        self.constraint = bundle_constraint(getattr(mm, "bundle", None), self.tokenizer)
        log.info("engine: %d KV blocks x %d tokens (%.1f MiB), %d slots, max_model_len %d", config.kv_blocks,
                 config.block_size, self.runner.cache.nbytes() / 2**20, mm.bank.num_slots, self.max_model_len)

    # ------------------------------------------------------------------------------------ requests
    def add_request(self, prompt_ids: list[int], params: SamplingParams, *, request_id: str | None = None,
                    adapter: str | None = None, allowed_adapters: list[str] | None = None,
                    routing: str = "auto", timeout_s: float | None = None,
                    queue_timeout_s: float | None = None, constraint: Constraint | None = None) -> str:
        """Queue a request; returns its id. Bad input raises a MoLoRAError and changes nothing.

        constraint: what its generated ids must obey (e.g. molora.structured.GrammarConstraint, compiled off this
        thread), on top of the bundle's constrained spans; a step where nothing is allowed ends the request with
        finish_reason "error" (see `_sample`). Routing is unaffected: the mask depends on the ids only.

        timeout_s: the request ends with finish_reason "timeout" once it has been in the engine this long;
        queue_timeout_s: the same if it has not started (been scheduled) by then. Both are checked at the start
        of every step, so they fire at the first step boundary past the deadline; KV blocks and pins are freed.
        """
        for name, value in (("timeout_s", timeout_s), ("queue_timeout_s", queue_timeout_s)):
            if value is not None and not value > 0:
                raise MoLoRAError(f"{name}={value} must be a positive number of seconds (or None: no limit)")
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
        route = RouteState(mode, len(prompt), router, adapter if mode == "pinned" else None, allowed, needs,
                           prompt_routes=[] if mode == "learned" and getattr(router, "probe_prompt", False) else None)
        req = Request(rid, prompt, params, route, generator=gen, detok=detok, text=TextState(tuple(params.stop)))
        req.arrival = time.monotonic()
        req.timeout_s, req.queue_timeout_s = timeout_s, queue_timeout_s
        req.constraints = [c.begin(prompt) for c in (self.constraint, constraint) if c is not None]
        self.requests[rid] = req
        self.scheduler.add(req)
        return rid

    def _resolve_routing(self, routing: str, adapter: str | None, allowed_adapters: list[str] | None
                         ) -> tuple[str, Any, frozenset[str] | None, tuple[str, ...]]:
        """(mode, router, allowed, adapters to pin) of a request's RouteState (molora.engine.routing). A draining adapter
        (unload_adapter) is refused to a pinned request and left out of a router's allowed set and pins."""
        if routing not in ROUTING_CHOICES:
            raise RoutingError(f"routing={routing!r}; choose one of {ROUTING_CHOICES}")
        hs = self.hotset
        hs.check_known([adapter] if adapter is not None else [])
        if adapter in hs.draining:
            raise AdapterDraining(f"adapter {adapter!r} is being unloaded (draining: only requests already using it "
                                  "may finish on it); choose another adapter, or load it again once it is gone")
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
        if routing == "arrow" and not isinstance(router, ArrowRouter):
            raise RoutingError(f"routing='arrow' needs a bundle whose router is Arrow (molora.json router kind "
                               f"\"arrow\"); the model has {type(router).__name__}")
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
        if hs.draining.intersection(names):  # as if absent: the allowed set (which routing obeys) leaves it out
            allowed = (allowed if allowed is not None else frozenset(hs.paths)) - hs.draining
        needs = tuple(n for n in names if allowed is None or n in allowed)
        if len(needs) > self.mm.bank.num_slots:
            raise RoutingError(f"this request may route to {len(needs)} adapters {list(needs)}, but the bank has "
                               f"{self.mm.bank.num_slots} slots; restrict allowed_adapters or attach with more slots")
        return mode, router, allowed, needs

    def abort(self, request_id: str, error: str | None = None) -> None:
        """Cancel a request: its KV blocks and pins are freed now; the next step reports it finished ("abort",
        with `error` as RequestOutput.error when given). Unknown or already finished ids are ignored."""
        req = self.requests.get(request_id)
        if req is not None:
            self._pending.append(self._end(req, "abort", error))

    def _end(self, req: Request, reason: str, error: str | None = None) -> RequestOutput:
        """Finish `req` now with `reason` (and `error`): free its KV blocks and pins, return its last output."""
        self.requests.pop(req.request_id, None)
        req.finish_reason, req.error = reason, error
        self.scheduler.finish(req)
        return req.output([], req.text.emit(final=True), [], None)

    def _expire(self, now: float) -> list[RequestOutput]:
        """End the requests past their deadline (add_request's timeout_s / queue_timeout_s)."""
        out = []
        for req in list(self.requests.values()):
            age = now - req.arrival
            if req.timeout_s is not None and age >= req.timeout_s:
                kind, why = "request", f"the request ran past its timeout of {req.timeout_s:g} s"
            elif req.queue_timeout_s is not None and not req.started and age >= req.queue_timeout_s:
                kind, why = "queue", (f"queue timeout: the request waited {age:.3g} s without starting (limit "
                                      f"{req.queue_timeout_s:g} s); the server is overloaded, retry later")
            else:
                continue
            self.deadlines_expired[kind] += 1
            self._event("deadline", kind)
            out.append(self._end(req, "timeout", why))
        return out

    def _event(self, kind: str, value: Any) -> None:
        self.events.append((kind, value))

    def has_unfinished(self) -> bool:
        return bool(self.requests) or bool(self._pending)

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
        outputs, self._pending = self._pending, []
        now = time.monotonic()
        outputs += self._expire(now)
        scheduled = self.scheduler.schedule()
        for req, why in self.scheduler.failed:
            log.error("request %s aborted: %s", req.request_id, why)
            self.requests.pop(req.request_id, None)
            req.finish_reason, req.error = "abort", why
            outputs.append(req.output([], "", [], None))
        self.scheduler.failed.clear()
        if not scheduled:
            if self.scheduler.waiting and not self.scheduler.running and not self.hotset.reads:
                head = self.scheduler.waiting[0]   # a bookkeeping bug, but this request's alone: end it
                why = (f"request {head.request_id!r} cannot be admitted on an idle engine "
                       f"({self.allocator.num_free} free KV blocks, adapters {list(head.needs)})")
                log.error("%s; ending it", why)
                outputs.append(self._fail(head, why))
            return outputs
        self.steps += 1
        for s in scheduled:
            if not s.request.started:
                s.request.started = True
                self._event("queue_wait", now - s.request.arrival)
        faults = self.faults
        outputs += self._run_isolating(scheduled)
        if self.faults != faults:
            self.check()   # a recovered fault must leave the scheduler, KV pool and pins consistent
        return outputs

    def _run_isolating(self, scheduled: list[Scheduled], top: bool = True) -> list[RequestOutput]:
        """_run(scheduled), bisecting on an exception to end only the request(s) that raise (see step)."""
        gens = {id(s.request): s.request.generator.get_state() for s in scheduled if s.request.generator is not None}
        try:
            return self._run(scheduled)
        except Exception as e:
            self.faults += 1
            for s in scheduled:                     # a sampled row may have drawn before the exception
                if id(s.request) in gens:
                    s.request.generator.set_state(gens[id(s.request)])
            error = e
        if isinstance(error, _CorruptSlots):        # every row of the step is spoiled: mend the slots, run again
            lost = self._mend(error.names)
            outs, keep = [], []
            for s in scheduled:
                gone = [n for n in lost if n in s.request.needs]
                if gone:
                    outs.append(self._fail(s.request, f"adapter {gone[0]!r} was corrupt in memory and could not be "
                                                      f"read again ({lost[gone[0]]}); it now adds nothing"))
                else:
                    keep.append(s)
            return outs + (self._run_isolating(keep, top) if keep else [])
        what = f"{type(error).__name__}: {error}"
        if top:  # one "fault" event per step that raised, however many re-runs isolate it
            self._event("fault", what)
        if len(scheduled) == 1:
            req = scheduled[0].request
            log.error("request %s failed alone (isolated): %s", req.request_id, what, exc_info=error)
            return [self._fail(req, f"the engine failed on this request ({what})")]
        log.warning("a step over %d chunks raised %s; running it again in halves to isolate the cause",
                    len(scheduled), what)
        mid = len(scheduled) // 2
        return self._run_isolating(scheduled[:mid], False) + self._run_isolating(scheduled[mid:], False)

    def _mend(self, names: list[str]) -> dict[str, str]:
        """Rewrite the corrupt slots of `names` from a fresh read of their folders (validated, so finite).
        Returns {name: why} of those that could not be read again; their slots are zeroed (the adapter adds
        nothing) and their CPU-tier copies dropped. Either way the slot is finite afterwards."""
        lost: dict[str, str] = {}
        bank = self.mm.bank
        for name in names:
            path = self.hotset.paths.get(name)
            try:
                if path is None:
                    raise AdapterError("it was given in memory: there is no folder to read it from")
                fresh = self.mm.read(name, path, roots=self.hotset.roots.get(name))
                bank.rewrite(name, fresh)
                self.mm.adapters[name] = fresh
                log.error("adapter %r was corrupt in its slot (non-finite weights); rewrote it from %s", name, path)
                self._event("repaired", name)
            except Exception as e:
                bank.rewrite(name, None)
                lost[name] = f"{type(e).__name__}: {e}"
                log.error("adapter %r was corrupt in its slot and could not be read again (%s); zeroed it", name,
                          lost[name])
            self.hotset.forget_warm(name)  # the warm copy may be what was corrupted
            self.hotset.forget_version(name)
        if self.prefix is not None:        # KV computed while the slot was corrupt must not be reused
            self.prefix.invalidate()
        return lost

    def _fail(self, req: Request, why: str) -> RequestOutput:
        """End one request on an error of its own: zero its KV rows (they may hold NaN that a later owner of
        these blocks would read through masked attention), free them, report finish_reason "error"."""
        self.failures += 1
        self._event("isolated", why)
        own = [b for b in req.block_table if self.allocator.refs(b) == 1]   # blocks shared with others stay
        self.allocator.forget(own)
        self.runner.cache.clear_blocks(own)
        return self._end(req, "error", why)

    def _run(self, scheduled: list[Scheduled]) -> list[RequestOutput]:
        """Compute one group of chunks (may raise: nothing but KV rows and generators changed yet), then commit
        each request's results on its own (an error there ends that request only)."""
        tokens, positions, meta = self._inputs(scheduled)
        routing = plan_routing(scheduled, self.hotset, self.runner.device)
        rows = [i for i, s in enumerate(scheduled) if s.samples]
        masks = self._fill_masks([scheduled[i].request for i in rows])               # while the step computes
        try:
            out = self.runner(tokens, positions, meta, routing, logits=rows)      # StepOutput, logits [b, V]
        finally:
            bitmask = masks.result() if masks is not None else None               # [c, W] of constrained rows
        last_slots, last_carry, carry_rows = out.last_slot_ids, out.last_carry, out.carry_rows
        # host reads of the step, batched (each is a device sync on a GPU): 1) whether the hidden states and each
        # sampled row's logits are finite (one reduction each: NaN and inf survive a sum), 2) the sampled ids with
        # the slot of each sequence's last token
        ok = torch.isfinite(out.hidden.sum()).reshape(1)
        best = None                    # each sampled row's greedy pick, from the same pass as its check (CPU)
        if rows:
            picked_ok = fused_cpu.greedy_rows(out.logits)
            best, rows_ok = picked_ok if picked_ok is not None else (None, torch.isfinite(out.logits.sum(-1)))
        flags = (ok if not rows else torch.cat([ok, rows_ok])).tolist()
        if not flags[0]:
            corrupt = self.mm.bank.nonfinite()
            if corrupt:
                raise _CorruptSlots(corrupt)
        logits = chosen = finite = picked = None
        dead: dict[int, str] = {}
        if rows:
            logits = out.logits
            finite = flags[1:]                                   # [b]
            chosen, dead = self._sample([scheduled[i].request for i in rows], logits, finite, best, bitmask)
            picked = (chosen if last_slots is None else torch.cat([chosen, last_slots[:, 0]])).tolist()
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
                outputs.append(self._fail(req, f"the model produced non-finite logits for this request (adapters "
                                               f"on its last token: {used or 'none'}); a corrupt adapter?"))
                continue
            if j in dead:   # its constraint allows no next id: it ends alone, the step goes on
                req.num_computed += s.n
                outputs.append(self._end(req, "error", dead[j]))
                continue
            try:
                if routing is not None and routing.carry is not None and last_carry is not None:
                    record_carry([s], last_carry[i:i + 1])
                if s.probe:  # a probe chunk; its prompt is computed again once the probe ends
                    ended = record_probe([s], carry_rows[off:off + s.n])[0]
                    req.num_computed = s.start + s.n
                    if ended:
                        self.scheduler.restart(req)
                else:
                    req.num_computed += s.n
                if self.prefix is not None:
                    self.prefix.publish(req)   # before _advance, which may free the table
                if j is not None:
                    slot = -1 if last_slots is None else picked[len(rows) + i]
                    lp = self._logprobs(req, logits[j], chosen[j])
                    outputs.append(self._advance(req, picked[j], table[slot] if slot >= 0 else None, lp))
            except Exception as e:
                log.error("request %s failed alone while committing its step: %s: %s", req.request_id,
                          type(e).__name__, e, exc_info=True)
                self.faults += 1
                outputs.append(self._fail(req, f"the engine failed on this request ({type(e).__name__}: {e})"))
        return outputs

    def check(self) -> None:
        """Assert the engine's bookkeeping: scheduler queues, KV pool and adapter pins agree with the requests."""
        self.scheduler.check()
        queued = {r.request_id for r in self.scheduler.waiting} | {r.request_id for r in self.scheduler.running}
        assert queued == set(self.requests), (sorted(queued ^ set(self.requests)), "requests and queues disagree")

    def _inputs(self, scheduled: list[Scheduled]) -> tuple[torch.Tensor, torch.Tensor, BatchMeta]:
        toks: list[int] = []
        pos: list[int] = []
        for s in scheduled:
            toks += s.request.tokens[s.start:s.start + s.n]
            pos += range(s.start, s.start + s.n)
        meta = BatchMeta([s.n for s in scheduled], [s.start + s.n for s in scheduled],
                         [s.request.block_table for s in scheduled])
        dev = self.runner.device
        return to_device(toks, dev), to_device(pos, dev), meta

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

    def _sample(self, reqs: list[Request], logits: torch.Tensor, finite: list[bool],
                best: torch.Tensor | None = None,
                bitmask: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[int, str]]:
        """(token ids [b], {row: why} of rows at a dead end) from logits [b, V] (best: their greedy picks, if known).

        Constraints (the bundle's spans, a request's grammar) are one packed bitmask per constrained row
        (molora.sampling.constraint_bitmask), applied in one batched op to the rows that need it: every sampled
        row, and a greedy row only when its unconstrained pick is not allowed (the argmax of the masked row is
        then the same id, so the mask costs a bit test), and then only if none of its top candidates is allowed
        (`masked_greedy`). A request short of its min_tokens picks from a copy of
        its row with its stop ids at -inf (`_without_stops`). A constrained row with nothing allowed is a dead
        end: it samples nothing and its request ends (see `_run`). `logits` itself is untouched, so logprobs
        report the model's distribution (vLLM's default, raw logprobs)."""
        b, V = logits.shape
        chosen = greedy(logits) if best is None else best                         # [b] greedy for all
        masked: dict[int, torch.Tensor] = {}                                       # row -> masked copy [1, V]
        dead: dict[int, str] = {}
        cons = [j for j, req in enumerate(reqs) if req.constraints]
        if cons:
            if bitmask is None or bitmask.shape[-1] != bitmask_words(V):   # not filled ahead (see _fill_masks)
                bitmask = constraint_bitmask([reqs[j].constraints for j in cons], [reqs[j].tokens for j in cons], V)
            bitmask = bitmask.to(logits.device)                                  # [c, W] int32
            ok = is_allowed(bitmask, chosen[cons]).tolist()                      # [c]
            empty = (bitmask == 0).all(-1).tolist()                               # [c]
            plain = [reqs[j].params.greedy and reqs[j].num_generated >= reqs[j].params.min_tokens for j in cons]
            # greedy rows whose pick is refused: the best allowed of their top candidates (masked_greedy)
            fast = [k for k in range(len(cons)) if not empty[k] and plain[k] and not ok[k]]
            if fast:
                chosen[[cons[k] for k in fast]] = masked_greedy(logits[[cons[k] for k in fast]], bitmask[fast])
            redo = [k for k in range(len(cons)) if not empty[k] and not plain[k]]   # sampled, or min_tokens
            if redo:
                idx = [cons[k] for k in redo]
                sub = apply_bitmask(logits[idx], bitmask[redo])                  # [r, V], one batched op
                chosen[idx] = greedy(sub)
                masked = {j: sub[k:k + 1] for k, j in enumerate(idx)}
            for k, j in enumerate(cons):
                if empty[k]:
                    dead[j] = self._dead_end_why(reqs[j])
        for j, req in enumerate(reqs):
            if j in dead:
                continue
            p = req.params
            row = masked.get(j, logits[j:j + 1])                                  # [1, V]
            if req.num_generated < p.min_tokens:
                row = self._without_stops(row, p)
                if j in masked and not bool(torch.isfinite(row).any()):         # the grammar allows only stops
                    dead[j] = self._dead_end_why(req)
                    continue
                chosen[j] = greedy(row)[0]
            if not p.greedy and finite[j]:
                chosen[j] = sample_next(row, p.temperature, p.top_k, p.top_p, req.generator)[0]
        return chosen, dead

    @staticmethod
    def _dead_end_why(req: Request) -> str:
        return (f"constraint dead end: after {req.num_generated} generated tokens the request's constraint allows no "
                "next token (its grammar is complete, or only an end token fits where ignore_eos or min_tokens "
                "forbids ending)")

    def _without_stops(self, row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
        """A copy of one row of logits [1, V] where the eos ids and p.stop_token_ids cannot be sampled (vLLM
        masks eos for min_tokens also under ignore_eos); ids outside the vocabulary are left out."""
        ids = sorted(t for t in self.eos_ids | set(p.stop_token_ids) if 0 <= t < row.shape[-1])
        row = row.clone()
        row[0, ids] = float("-inf")
        return row

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
        check = req.num_generated > p.min_tokens   # the first min_tokens tokens never stop (vLLM's min_tokens)
        if check and ((token in self.eos_ids and not p.ignore_eos) or token in p.stop_token_ids):
            reason = "stop"
        elif req.text.append(req.detok.add(token) if req.detok is not None else "", check):
            reason, cut = "stop", True
        if reason is None and (req.num_generated >= p.max_new_tokens or len(req.tokens) >= self.max_model_len):
            reason = "length"
        if reason is not None and not cut and req.detok is not None:
            if req.text.append(req.detok.flush(), check):  # bytes held back at the end may complete a stop string
                reason = "stop"
        text = req.text.emit(final=reason is not None)
        if reason is not None:
            req.finish_reason = reason
            self.scheduler.finish(req)
            del self.requests[req.request_id]
        return req.output([token], text, [adapter], lp)

    def reset(self, why: str) -> list[RequestOutput]:
        """End every request in flight with finish_reason "error" and `why` (after an engine bug); their
        outputs are returned. The KV cache rows are zeroed."""
        outs = [self._end(req, "error", why) for req in list(self.requests.values())]
        if self.prefix is not None:
            self.prefix.invalidate()
        self.runner.cache.clear_blocks(range(self.allocator.num_blocks))
        return outs

    # ------------------------------------------------------------------------------------ offline use
    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                 **kw: Any) -> list[RequestOutput]:
        """Run `prompts` to completion; one aggregated output per prompt, in order. Keyword arguments go to
        add_request; `adapter`, `routing`, `constraint` and `allowed_adapters` may also be given per prompt as lists.
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
                a.cached_tokens = out.cached_tokens
                a.error = out.error if out.error is not None else a.error
        return [agg[rid] for rid in ids]

    # ------------------------------------------------------------------------------------ adapters, stats
    def read_adapter(self, name: str, path: str | Path, *, roots: Sequence[str | Path] | None = None) -> LoRAAdapter:
        """Read and validate a PEFT folder for `load_adapter` (fits the bank; with `roots`, every file must
        resolve inside one of them). Touches no engine state: call it on any thread, e.g. a server's
        `asyncio.to_thread`, then `load_adapter(name, adapter)` on the engine thread."""
        return self.hotset.read(name, path, roots)

    def load_adapter(self, name: str, source: str | Path | LoRAAdapter, *,
                     roots: Sequence[str | Path] | None = None) -> None:
        """Register an adapter at run time: a PEFT folder (read and validated here, on this thread) or an
        adapter from `read_adapter`. Loaded into a free slot if there is one. `roots` confine every later
        re-read of the folder (an adapter from read_adapter keeps the roots it was read with). Refused, with
        nothing changed, for a bad folder, a name in use, or a name still draining."""
        self.hotset.register(name, source, roots)

    def unload_adapter(self, name: str, force: bool = False) -> str:
        """Unload an adapter: "unloaded" when it is gone now, "draining" when requests in flight (running or
        queued) may still route to it: new requests no longer do, and it is unloaded when the last of those
        finishes (Scheduler.finish). force=True aborts those requests (finish_reason "abort", with an error
        naming the adapter) and unloads it now. Unknown names raise AdapterError."""
        hs = self.hotset
        hs.check_known([name])
        users = self.scheduler.users(name)
        if force:
            why = f"adapter {name!r} was unloaded (force) while this request used it"
            for req in users:
                self.abort(req.request_id, error=why)
            if name in hs.paths:     # the last abort already unregistered it if it was draining
                hs.unregister(name)
            log.info("adapter %r unloaded (force), %d request(s) aborted", name, len(users))
            return "unloaded"
        if not users:
            hs.unregister(name)
            return "unloaded"
        if name not in hs.draining:
            hs.drain(name)
            log.info("adapter %r draining: %d request(s) in flight use it", name, len(users))
        return "draining"

    def list_adapters(self) -> list[dict]:
        """name, path, slot (or None), tier ("slot" | "cpu" | "disk"), pin count and state ("ready" |
        "loading": a background read is in flight | "draining": being unloaded) of every adapter."""
        return self.hotset.describe()

    def close(self) -> None:
        """Stop the adapter loader thread (HotSet.close) and the mask filler; the engine still works, a later miss
        or constrained step restarts them."""
        self.hotset.close()
        if self._mask_pool is not None:
            self._mask_pool.shutdown()
            self._mask_pool = None

    def stats(self) -> dict:
        """Counters and the current state, read at every /metrics scrape (cheap: one pass over the requests).

        `lora_requests` is what an inference gateway routes on (vLLM's `lora_requests_info`): the adapters the
        running and the waiting requests route to, each sorted, and `max_lora`, the bank's slots (the most
        adapters resident at once). A request's adapters are its pins (`Request.needs`): a pinned request's
        one adapter; a per-token request's every adapter its router may choose within its allowed set (at most
        the slots; all of them resident while it runs). A base-model request names none."""
        sched, g = self.scheduler, self.runner.graphs
        lora = {"running": sorted({n for r in sched.running for n in r.needs}),
                "waiting": sorted({n for r in sched.waiting for n in r.needs}),
                "max_lora": self.mm.bank.num_slots}
        return {"num_waiting": len(sched.waiting), "num_running": len(sched.running),
                "kv_blocks_total": self.allocator.num_blocks, "kv_blocks_free": self.allocator.num_free,
                "hotset": self.hotset.stats(), "tokens_by_adapter": dict(self.tokens_by_adapter),
                "tokens_generated": self.tokens_generated, "tokens_computed": self.tokens_computed,
                "steps": self.steps, "num_preemptions": sched.num_preemptions,
                "faults": self.faults, "failed_requests": self.failures,
                "deadlines_expired": dict(self.deadlines_expired), "lora_requests": lora,
                "decode_graphs": None if g is None else {"captured": g.captures, "replays": g.replays,
                                                          "failed": len(g.failed)},
                "prefix_cache": self.prefix.stats() if self.prefix is not None else {"enabled": False}}


class _CorruptSlots(Exception):
    """A step met non-finite adapter weights in the bank (Engine._mend)."""

    def __init__(self, names: list[str]) -> None:
        super().__init__(f"non-finite weights in the slots of {names}")
        self.names = names


def _per_prompt(key: str, value: Any, i: int, n: int) -> Any:
    """A generate() keyword's value for prompt i: lists of per-prompt values are indexed."""
    if key in ("adapter", "routing", "request_id", "constraint") and isinstance(value, list):
        return value[i]
    if key == "allowed_adapters" and isinstance(value, list) and value and \
            all(v is None or isinstance(v, list) for v in value) and len(value) == n:
        return value[i]
    return value
