"""KV block bookkeeping: which cache blocks are free, and growing / freeing a sequence's block table.

The cache tensors themselves live in `molora.model.runner.PagedKVCache`; this module only hands out block
ids (integers in [0, num_blocks)). A block table is a plain `list[int]` owned by its request; row p of a
sequence sits in block table[p // block_size] at offset p % block_size.

Knows nothing about tensors, models, adapters or requests beyond their block tables. Every block is either
in the free list or in exactly one table: `check()` asserts it (the resource-safety tests call it).
"""

from __future__ import annotations

from collections.abc import Iterable

from molora.errors import MoLoRAError


class BlockAllocator:
    """A free list of `num_blocks` KV blocks of `block_size` rows each."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise MoLoRAError(f"the KV cache needs num_blocks >= 1 and block_size >= 1, got {num_blocks}, "
                              f"{block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # a stack: pop() hands out block 0 first
        self._used = [False] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_for(self, length: int) -> int:
        """Blocks a sequence of `length` cached rows occupies."""
        return -(-length // self.block_size)

    def can_grow(self, table: list[int], length: int) -> bool:
        return self.blocks_for(length) - len(table) <= len(self._free)

    def grow(self, table: list[int], length: int) -> bool:
        """Append blocks to `table` until it covers `length` rows. All or nothing: False if too few are free."""
        need = self.blocks_for(length) - len(table)
        if need > len(self._free):
            return False
        for _ in range(need):
            block = self._free.pop()
            assert not self._used[block], f"block {block} handed out twice"
            self._used[block] = True
            table.append(block)
        return True

    def free(self, table: list[int]) -> None:
        """Return every block of `table` to the free list and empty the table (in place)."""
        for block in table:
            assert self._used[block], f"block {block} freed twice"
            self._used[block] = False
            self._free.append(block)
        table.clear()

    def check(self, tables: Iterable[list[int]]) -> None:
        """Assert the pool is consistent: the given tables and the free list partition all blocks."""
        held = [b for t in tables for b in t]
        assert len(held) == len(set(held)), "a block sits in two tables"
        assert len(held) + len(self._free) == self.num_blocks, \
            f"{len(held)} held + {len(self._free)} free != {self.num_blocks} blocks"
        assert set(held).isdisjoint(self._free), "a held block is also free"
