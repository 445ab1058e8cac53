"""Prefix caching that knows per-token routing: a full KV block is reused only where every token ran on
the same adapters.

With LoRA on q/k/v, a token's KV depends on the tokens before it and on the adapters each of them ran on at
every block. So a full block of KV is keyed by a chain (vLLM's hashed blocks, with routing in the key):

    key(block j) = BlockKey(key(block j - 1), (its token ids, what each token ran on))    key(-1) = salt

where "what each token ran on" is `molora.engine.routing.token_routes`: a per-token adapter content version
(pinned, token-id routers, a probed prompt's fixed decisions, the base: -1), or, where decisions come from
the in-network router's gates, the router and the content versions of the adapters it may choose (the gates
are a function of the tokens before and of those: a hit on the same chain is the same computation). The
salt holds the model and its dtype. Keys compare by content (their hash is cached), so two chains meet only
if they are equal all the way down: a hash collision cannot serve wrong KV. An adapter reloaded, re-read or
repaired gets a new content version (HotSet.content_version), so its old blocks can never match again; they
age out of the LRU. Whatever `token_routes` cannot prove (an adapter the request does not pin, a carried
decision not yet known) ends the chain there: a miss.

Which routing modes hit (any two requests whose chains are equal share, whatever their modes: a pinned
request and a probed prompt whose fixed decisions all name the same adapter compute the same KV):
  none, pinned, token-id routers (vocab)   hit on equal token prefixes under the same adapter versions
  learned / Arrow without probe            hit on equal token prefixes under the same router and choosable
                                           adapters (gates are causal); generated tokens of a carrying
                                           router carry their predecessor's decision: they hit only a chain
                                           with the same carried decisions (a recomputed request's own)
  learned with probe                       the probe pass hits like the above; the real pass hits only where
                                           the filled decisions (and the base-expert verdict) are equal: they
                                           depend on the whole prompt (its most frequent adapter, its share of
                                           claimed tokens), so a shared system prompt before different
                                           questions may run on different adapters, and then it misses
A top-k token-id router keys each token by its (version, weight) pairs. A token routed to a registered
adapter the request does not pin (it could be resident or not) cannot be proven: the chain ends there.

A request's own pass over its tokens starts at the cached length (as chunked prefill does) and always
computes at least its last token (its logits are needed). A learned router's probe pass (molora.routing.
learned: Probe) is keyed the same way, with every token on its gates, and its blocks carry the probe's own
decisions (`BlockAllocator.meta`): a probe that hits over the whole prompt is finished without a forward,
otherwise it resumes after the cached blocks. When the probe ends the request drops its probe blocks and
looks its real pass up by the probe's decisions (a prompt kept on the base model looks up base blocks).
A request that scores its prompt (SamplingParams.prompt_logprobs) takes no cached blocks, neither at admission nor
later: it needs the logits of every prompt position, which a cached block does not hold; it still publishes its own.

Owns the keys, the per-request key chains (`Request.prefix`) and the hit counters; the blocks, reference
counts and LRU are the allocator's (molora.engine.kv). Knows nothing about tensors or HTTP.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from molora.engine.hotset import HotSet
from molora.engine.kv import BlockAllocator
from molora.engine.request import Request
from molora.engine.routing import finish_probe, token_routes


class BlockKey:
    """One block's content key: its parent's key and (token ids, per-token descriptors). Hash cached, equality
    by content down the chain (identical parents short-circuit)."""

    __slots__ = ("_hash", "content", "parent")

    def __init__(self, parent: BlockKey | tuple, content: tuple) -> None:
        self.parent, self.content = parent, content
        self._hash = hash((hash(parent), content))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return self is other or (
            isinstance(other, BlockKey)
            and self._hash == other._hash
            and self.content == other.content
            and self.parent == other.parent
        )


@dataclass(eq=False)
class PrefixState:
    """A request's key chain for its current pass (rebuilt at every admission: versions are read under pins)."""

    probe: bool  # the keys are the probe pass's
    epoch: int  # PrefixCache.epoch when built; another epoch: publish nothing more
    keys: list[BlockKey] = field(default_factory=list)
    published: int = 0  # blocks of the table already keyed (shared hits or published)


class PrefixCache:
    """Content-addressed KV blocks over a `BlockAllocator` (module docstring)."""

    def __init__(self, allocator: BlockAllocator, hotset: HotSet, salt: tuple) -> None:
        self.allocator, self.hotset, self.salt = allocator, hotset, salt
        self.bs = allocator.block_size
        self.epoch = 0
        self.queried_tokens = self.hit_tokens = 0  # the real pass's lookups (a preempted request's too)
        self.probe_queried_tokens = self.probe_hit_tokens = 0

    # ------------------------------------------------------------------------------------ lookups
    def match(self, req: Request) -> list[int]:
        """Cached blocks that `req` can take from its first token on (nothing is changed but, when a probe
        is cached over the whole prompt, the request's routing state: its probe is then finished here).
        Call it while req's adapters are pinned. `take` commits what the caller admitted."""
        if req.probing:
            req.prefix = PrefixState(True, self.epoch)
            blocks = self._walk(req, req.route.prompt_len // self.bs, probe=True)
            if len(blocks) * self.bs < req.route.prompt_len:
                return blocks
            req.route.prompt_routes = [d for b in blocks for d in self.allocator.meta(b)]
            finish_probe(req.route)  # the whole probe came from the cache: no probe pass at all
            self.probe_queried_tokens += req.route.prompt_len
            self.probe_hit_tokens += req.route.prompt_len
        req.prefix = PrefixState(False, self.epoch)
        if req.params.prompt_logprobs is not None:
            return []  # it scores every prompt position: a cached block would skip their logits (it still publishes)
        return self._walk(req, (len(req.tokens) - 1) // self.bs, probe=False)  # the last token is computed

    def in_flight(self, running: list[Request]) -> set[BlockKey]:
        """Keys of the full blocks that running requests are computing and will publish (their chains beyond
        what they have published)."""
        return {
            k
            for r in running
            if r.prefix is not None and r.prefix.epoch == self.epoch
            for k in r.prefix.keys[r.prefix.published :]
        }

    def computing(self, req: Request, upto: int) -> list[BlockKey]:
        """Keys of req's blocks that it is computing (unpublished) below token `upto`."""
        st = req.prefix
        if st is None or st.epoch != self.epoch:
            return []
        return st.keys[st.published : -(-upto // self.bs)]

    def behind(self, req: Request, start: int, in_flight: set[BlockKey]) -> bool:
        """True if req's block `start` (the first it would compute itself) is being computed by another request:
        a step or two later req takes it from the cache instead of computing the same KV again (32 requests
        arriving together with one system prompt compute it once, not 32 times)."""
        keys = req.prefix.keys if req.prefix is not None else []
        return len(keys) > start and keys[start] in in_flight

    def extend(self, req: Request) -> bool:
        """A running request in its real pass, at a block boundary with all its blocks keyed, takes the blocks
        published since it was admitted (by requests that were ahead of it) and starts after them. True if it
        is at such a boundary (then `behind` may hold it back), False if it is inside a block of its own."""
        st, table = req.prefix, req.block_table
        if (
            st is None
            or st.probe
            or req.params.prompt_logprobs is not None  # scores every prompt position (`match`)
            or st.epoch != self.epoch
            or st.published != len(table)
            or req.num_computed != len(table) * self.bs
        ):
            return False
        limit = (len(req.tokens) - 1) // self.bs  # the last token is computed
        keys, found = self._keys(req, limit), []
        for j in range(len(table), len(keys)):
            block = self.allocator.lookup(keys[j])
            if block is None:
                break
            found.append(block)
        if found:
            self.allocator.share(table, found)
            n = len(found) * self.bs
            st.published = len(table)
            req.num_computed += n
            req.cached_tokens = (req.cached_tokens or 0) + n
            self.hit_tokens += n
        return True

    def take(self, req: Request, blocks: list[int]) -> None:
        """`req` was admitted holding `blocks` (from `match`, now in its table): it starts after them."""
        st, n = req.prefix, len(blocks) * self.bs
        st.published = len(blocks)
        req.num_computed = n
        if st.probe:
            req.route.prompt_routes = [d for b in blocks for d in self.allocator.meta(b)]
            self.probe_queried_tokens += req.route.prompt_len
            self.probe_hit_tokens += n
        else:
            if req.cached_tokens is None:
                req.cached_tokens = n
            self.queried_tokens += len(req.tokens)
            self.hit_tokens += n

    def _walk(self, req: Request, limit: int, probe: bool) -> list[int]:
        """The longest chain of cached blocks over req's first `limit` full blocks."""
        out: list[int] = []
        keys = self._keys(req, limit)
        for i, key in enumerate(keys):
            block = self.allocator.lookup(key)
            if block is None or (probe and self.allocator.meta(block) is None):
                break
            stored = self.allocator.key_of(block)  # the stored key object: later parents compare by identity
            assert isinstance(stored, BlockKey), f"cached block {block} holds a key of another kind: {stored!r}"
            keys[i] = stored
            if i + 1 < len(keys):
                keys[i + 1] = BlockKey(keys[i], keys[i + 1].content)
            out.append(block)
        return out

    def _keys(self, req: Request, n: int) -> list[BlockKey]:
        """req.prefix.keys extended to n blocks where `token_routes` can prove what their tokens ran on."""
        st, bs = req.prefix, self.bs
        while len(st.keys) < n:
            j = len(st.keys)
            routes = token_routes(req, self.hotset, j * bs, (j + 1) * bs, st.probe)
            if routes is None:
                break
            parent = st.keys[-1] if st.keys else self.salt
            st.keys.append(BlockKey(parent, (tuple(req.tokens[j * bs : (j + 1) * bs]), tuple(routes))))
        return st.keys

    # ------------------------------------------------------------------------------------ publishing
    def publish(self, req: Request) -> None:
        """Key every full block of req's table that it has computed since the last call."""
        st = req.prefix
        if st is None or st.epoch != self.epoch:
            return
        full = min(req.num_computed // self.bs, len(req.block_table))
        if full <= st.published:
            return
        keys = self._keys(req, full)
        raw = (req.route.probe_raw or req.route.prompt_routes) if st.probe else None
        for j in range(st.published, min(full, len(keys))):
            meta = raw[j * self.bs : (j + 1) * self.bs] if raw is not None else None
            if st.probe and (meta is None or len(meta) < self.bs):
                break
            self.allocator.publish(req.block_table[j], keys[j], meta)
            st.published = j + 1

    def invalidate(self) -> None:
        """Forget every cached block (an adapter slot was repaired in place, or the cache was cleared); requests
        in flight publish nothing more."""
        self.epoch += 1
        self.allocator.forget_all()

    def stats(self) -> dict[str, Any]:
        q, h = self.queried_tokens, self.hit_tokens
        return {
            "enabled": True,
            "queried_tokens": q,
            "hit_tokens": h,
            "hit_rate": h / q if q else 0.0,
            "probe_queried_tokens": self.probe_queried_tokens,
            "probe_hit_tokens": self.probe_hit_tokens,
            "cached_blocks": self.allocator.num_cached,
            "evictions": self.allocator.evictions,
        }
