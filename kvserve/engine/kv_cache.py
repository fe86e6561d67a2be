"""Paged KV cache bookkeeping: the block pool and per-sequence block tables.

Only :class:`KVCacheManager` touches free lists, reference counts and block
tables (one writer); the scheduler asks it for room and gets True/False back.
The KV tensors themselves live in the model runner (the only code that touches
devices): block ``b`` holds cache rows ``b * block_size ... b * block_size +
block_size - 1`` in every layer.

Blocks are reference counted and remember their tokens, so the prefix cache
(hash-chained full blocks shared between sequences) can be layered on top
without changing callers.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Block:
    """One fixed-size page of KV: id, reference count and the tokens it holds."""

    block_id: int
    ref_count: int = 0
    token_ids: list[int] = field(default_factory=list)


class KVCacheManager:
    """Allocates fixed-size KV blocks to sequences.

    Args:
        num_blocks: blocks in the pool (each ``block_size`` tokens, all layers).
        block_size: tokens per block (default 16, as vLLM).

    Thread-safety: engine thread only.
    """

    def __init__(self, num_blocks: int, block_size: int = 16):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() gives low ids first
        self._tables: dict[str, list[int]] = {}

    # -- queries -----------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use (0..1)."""
        return 1.0 - len(self._free) / self.num_blocks

    def block_table(self, request_id: str) -> list[int]:
        """The sequence's block ids in position order (empty if it has none)."""
        return self._tables.get(request_id, [])

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- updates -----------------------------------------------------------------

    def allocate(self, request_id: str, num_tokens: int) -> bool:
        """Make the sequence's table cover ``num_tokens`` tokens.

        Returns False (and changes nothing) when the pool lacks free blocks.
        """
        table = self._tables.setdefault(request_id, [])
        need = self.blocks_needed(num_tokens) - len(table)
        if need <= 0:
            return True
        if need > len(self._free):
            if not table:
                del self._tables[request_id]
            return False
        for _ in range(need):
            b = self.blocks[self._free.pop()]
            b.ref_count = 1
            b.token_ids = []
            table.append(b.block_id)
        return True

    def record_tokens(self, request_id: str, start: int, token_ids: list[int]) -> None:
        """Note that positions ``start..`` of the sequence now hold ``token_ids`` in the cache."""
        table = self._tables[request_id]
        bs = self.block_size
        pos = start
        for t in token_ids:
            blk = self.blocks[table[pos // bs]]
            off = pos % bs
            if off < len(blk.token_ids):
                del blk.token_ids[off:]
            blk.token_ids.append(t)
            pos += 1

    def free(self, request_id: str) -> None:
        """Drop the sequence's references; blocks reaching zero return to the pool."""
        for bid in reversed(self._tables.pop(request_id, [])):
            b = self.blocks[bid]
            b.ref_count -= 1
            if b.ref_count <= 0:
                b.ref_count = 0
                b.token_ids = []
                self._free.append(bid)
