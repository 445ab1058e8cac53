"""KV block bookkeeping: which cache blocks are free, shared or cached, and growing / freeing a block table.

The cache tensors themselves live in `molora.model.runner.PagedKVCache`; this module only hands out block
ids (integers in [0, num_blocks)). A block table is a plain `list[int]` owned by its request; row p of a
sequence sits in block table[p // block_size] at offset p % block_size.

Every block is in exactly one of three states:
  free       on the free list: no content anyone may reuse;
  held       referenced by `ref` >= 1 block tables (a full, content-addressed block may sit in several);
  cached     referenced by none, but still holding the KV of a content key (`publish`): it can be
             `share`d again by key, and is evicted (least recently released first) when `grow` finds the
             free list empty. Cached blocks count as free-able (`num_free`).
A block that is held may carry a key too (it was published, or shared from the cache). What a key means is
the prefix cache's business (molora.engine.prefix); here it is an opaque hashable with optional metadata.

Knows nothing about tensors, models, adapters or requests beyond their block tables. `check()` asserts
that the reference counts equal the tables' contents and that the three states partition the pool.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Hashable, Iterable
from typing import Any

from molora.errors import MoLoRAError


class BlockAllocator:
    """A pool of `num_blocks` KV blocks of `block_size` rows: free list, reference counts, cached blocks."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise MoLoRAError(f"the KV cache needs num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # a stack: pop() hands out block 0 first
        self._ref = [0] * num_blocks
        self._key: dict[int, Hashable] = {}  # block -> content key (held or cached)
        self._block: dict[Hashable, int] = {}  # content key -> block
        self._meta: dict[int, Any] = {}  # block -> what its publisher stored beside the KV
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced blocks: first = evicted first
        self.evictions = 0

    @property
    def num_free(self) -> int:
        """Blocks `grow` can hand out: the free list plus the unreferenced cached blocks (evicted on demand)."""
        return len(self._free) + len(self._lru)

    @property
    def num_cached(self) -> int:
        """Blocks holding a content key (held or not)."""
        return len(self._key)

    def blocks_for(self, length: int) -> int:
        """Blocks a sequence of `length` cached rows occupies."""
        return -(-length // self.block_size)

    def can_grow(self, table: list[int], length: int, shared: Iterable[int] = ()) -> bool:
        """Whether `share(table, shared)` then `grow(table, length)` would succeed."""
        shared = list(shared)
        need = self.blocks_for(length) - len(table) - len(shared)
        return need <= self.num_free - sum(1 for b in shared if b in self._lru)

    def grow(self, table: list[int], length: int) -> bool:
        """Append blocks to `table` until it covers `length` rows. All or nothing: False if too few are free.
        Takes the free list first, then evicts the least recently released cached blocks."""
        need = self.blocks_for(length) - len(table)
        if need > self.num_free:
            return False
        for _ in range(need):
            if self._free:
                block = self._free.pop()
            else:
                block, _ = self._lru.popitem(last=False)
                self._drop_key(block)
                self.evictions += 1
            assert self._ref[block] == 0, f"block {block} handed out twice"
            self._ref[block] = 1
            table.append(block)
        return True

    def free(self, table: list[int]) -> None:
        """Release every block of `table` and empty it (in place). A block nobody holds any more goes back to
        the free list, or, if it has a key, to the cache (the table's last blocks become the first evicted:
        a later block is of no use without the ones before it)."""
        for block in reversed(table):
            assert self._ref[block] > 0, f"block {block} freed twice"
            self._ref[block] -= 1
            if self._ref[block] == 0:
                if block in self._key:
                    self._lru[block] = None
                else:
                    self._free.append(block)
        table.clear()

    def truncate(self, table: list[int], length: int) -> None:
        """Release the blocks of `table` beyond the first `length` rows (a rejected speculative draft's rows). They
        are the table's own: held by it alone and unkeyed (only full computed blocks are published)."""
        keep = self.blocks_for(length)
        while len(table) > keep:
            block = table.pop()
            assert self._ref[block] == 1 and block not in self._key, f"block {block} is shared or keyed"
            self._ref[block] = 0
            self._free.append(block)

    # ------------------------------------------------------------------------------------ content keys
    def lookup(self, key: Hashable) -> int | None:
        """The block holding `key`'s content, held or cached; None if there is none."""
        return self._block.get(key)

    def refs(self, block: int) -> int:
        """How many block tables hold `block`."""
        return self._ref[block]

    def key_of(self, block: int) -> Hashable | None:
        return self._key.get(block)

    def meta(self, block: int) -> Any:
        return self._meta.get(block)

    def share(self, table: list[int], blocks: Iterable[int]) -> None:
        """Append blocks found by `lookup` to `table`, taking a reference on each."""
        for block in blocks:
            assert block in self._key, f"block {block} has no content key: it cannot be shared"
            if self._ref[block] == 0:
                del self._lru[block]
            self._ref[block] += 1
            table.append(block)

    def publish(self, block: int, key: Hashable, meta: Any = None) -> bool:
        """Give a held, fully written block the content key `key` (and `meta`). False, changing nothing, when
        another block already holds that key or this block holds another one."""
        assert self._ref[block] > 0, f"block {block} is published but held by no table"
        if key in self._block or block in self._key:
            return False
        self._key[block], self._block[key] = key, block
        if meta is not None:
            self._meta[block] = meta
        return True

    def forget(self, blocks: Iterable[int]) -> None:
        """Drop the keys of these blocks (their content must not be reused); cached ones become free."""
        for block in blocks:
            if block in self._key:
                self._drop_key(block)
                if block in self._lru:
                    del self._lru[block]
                    self._free.append(block)

    def forget_all(self) -> None:
        self.forget(list(self._key))

    def _drop_key(self, block: int) -> None:
        del self._block[self._key.pop(block)]
        self._meta.pop(block, None)

    def check(self, tables: Iterable[list[int]]) -> None:
        """Assert the pool is consistent: reference counts equal how often the given tables hold each block,
        and free, held and cached blocks partition the pool."""
        held = Counter(b for t in tables for b in t)
        assert all(self._ref[b] == held.get(b, 0) for b in range(self.num_blocks)), [
            (b, self._ref[b], held.get(b, 0)) for b in range(self.num_blocks) if self._ref[b] != held.get(b, 0)
        ]
        assert len(self._free) == len(set(self._free)), "a block is on the free list twice"
        assert not held.keys() & set(self._free) and not held.keys() & self._lru.keys(), "a held block is also free"
        assert not set(self._free) & self._key.keys(), "a free block keeps a content key"
        assert all(b in self._key for b in self._lru), "a cached block without a key"
        assert len(held) + len(self._free) + len(self._lru) == self.num_blocks, (
            f"{len(held)} held + {len(self._free)} free + {len(self._lru)} cached != {self.num_blocks} blocks"
        )
        assert all(self._block[k] == b for b, k in self._key.items()) and len(self._block) == len(self._key)
        assert self._meta.keys() <= self._key.keys()
