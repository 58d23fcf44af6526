"""The physical block pool of a paged KV cache: ref counts, a free queue in eviction order, and the
prefix-cache index (vLLM, Kwon et al. SOSP'23, arXiv 2309.06180).

Boundary: plain Python ints, lists and dicts — no torch. The pool does not know what a block holds,
which row uses it, or how tokens map to slots; ``block_table.py`` does that on top of it.

Invariants (checked by the hypothesis state machine in ``tests/cache/test_block_pool.py``):
    I1  every block is either used (ref > 0) or in the free queue (ref == 0), never both:
        ``num_free() + num_used() == num_blocks``.
    I2  ``_hash_of`` and ``_block_of`` are inverse maps: a hash names at most one block and vice versa.
    I3  a hashed block is full and immutable; a writer copies it first (copy-on-write, see
        ``is_writable``). A hashed block with ref 0 stays in the free queue *and* in the index — a
        "cached free" block — until allocation evicts it (lazy eviction).

Eviction order: ``allocate`` pops from the front of the free queue; ``free`` appends to the back, and
a row's blocks are appended tail first, so a sequence's prefix blocks (the most shareable) are evicted
last. A cached free block that gets a prefix hit leaves the queue; when freed again it re-enters at
the back — least-recently-used eviction.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence


class OutOfBlocksError(RuntimeError):
    """The pool cannot supply the blocks a step needs; nothing was allocated."""

    def __init__(self, needed: int, free: int, total: int):
        self.needed, self.free, self.total = needed, free, total
        super().__init__(
            f"PagedCache is out of KV blocks: this step needs {needed} new block(s) but only {free} of {total} are "
            "free. Give the cache more blocks (num_blocks=... or memory_budget=...), lower the batch size or "
            "max_new_tokens, or call cache.reset() to release finished sequences."
        )


class BlockPool:
    """``num_blocks`` fixed-size blocks of ``block_size`` token slots each."""

    def __init__(self, num_blocks: int, block_size: int):
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be a positive integer, got {num_blocks!r}.")
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}.")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._ref = [0] * num_blocks
        # An OrderedDict is a hash map over a doubly linked list: O(1) pop from the front, append at the
        # back, *and* removal from the middle (a prefix hit on a cached free block) — a plain deque would
        # make that last one O(n). Values are unused.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._hash_of: dict[int, bytes] = {}
        self._block_of: dict[bytes, int] = {}

    # ---- queries -------------------------------------------------------------------------------
    def num_free(self) -> int:
        """Blocks with ref 0 (including cached free blocks, which are reusable)."""
        return len(self._free)

    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def num_cached(self) -> int:
        """Blocks registered in the prefix index (used or cached free)."""
        return len(self._hash_of)

    def ref_count(self, block: int) -> int:
        return self._ref[block]

    def free_queue(self) -> list[int]:
        """Free block ids in eviction order (next to be allocated first)."""
        return list(self._free)

    def block_hash(self, block: int) -> bytes | None:
        return self._hash_of.get(block)

    def lookup(self, block_hash: bytes) -> int | None:
        """The block cached under ``block_hash``, or None."""
        return self._block_of.get(block_hash)

    def is_writable(self, block: int) -> bool:
        """A row may write into ``block`` in place only if it is the sole owner and the block is not cached."""
        return self._ref[block] == 1 and block not in self._hash_of

    # ---- mutations -----------------------------------------------------------------------------
    def allocate(self, n: int = 1) -> list[int]:
        """``n`` fresh blocks with ref 1, evicting cached free blocks as needed; all or nothing."""
        if n > len(self._free):
            raise OutOfBlocksError(n, len(self._free), self.num_blocks)
        blocks = []
        for _ in range(n):
            block, _ = self._free.popitem(last=False)
            self._evict(block)
            self._ref[block] = 1
            blocks.append(block)
        return blocks

    def incref(self, block: int) -> None:
        """One more owner; revives a cached free block (prefix hit) out of the free queue."""
        if self._ref[block] == 0:
            if block not in self._hash_of:
                raise ValueError(f"Block {block} is free and not cached; allocate() it instead of sharing it.")
            del self._free[block]
        self._ref[block] += 1

    def decref(self, block: int) -> None:
        """One owner fewer; at ref 0 the block joins the back of the free queue (keeping its hash)."""
        if self._ref[block] <= 0:
            raise ValueError(f"Double free of block {block}: its ref count is already 0.")
        self._ref[block] -= 1
        if self._ref[block] == 0:
            self._free[block] = None

    def free(self, blocks: Sequence[int]) -> None:
        """Release one row's blocks, tail first (so its prefix is evicted last)."""
        for block in reversed(blocks):
            self.decref(block)

    def cache_block(self, block: int, block_hash: bytes) -> int:
        """Register a full, used block under ``block_hash``; returns the block now cached for that hash.

        If another block already holds this hash (two rows computed the same prefix), the index keeps
        the existing one and ``block`` stays an ordinary private block.
        """
        if self._ref[block] == 0:
            raise ValueError(f"Block {block} is free; only used (full) blocks can be cached.")
        existing = self._block_of.get(block_hash)
        if existing is not None:
            return existing
        if block in self._hash_of:
            raise ValueError(f"Block {block} is already cached under another hash.")
        self._hash_of[block] = block_hash
        self._block_of[block_hash] = block
        return block

    def uncache(self, blocks: Iterable[int]) -> None:
        """Drop blocks from the prefix index (e.g. when the cache's storage is discarded)."""
        for block in blocks:
            self._evict(block)

    def _evict(self, block: int) -> None:
        block_hash = self._hash_of.pop(block, None)
        if block_hash is not None:
            del self._block_of[block_hash]
