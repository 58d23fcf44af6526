"""Per-row block tables over a ``BlockPool``: grow, fork, select, truncate, copy-on-write, prefix attach.

Boundary: plain Python bookkeeping, no torch. It decides *which* physical block holds each logical
token and reports the block copies that copy-on-write needs; the tensor side (``paged.py``) performs
those copies and the actual K/V writes.

Token ``t`` of row ``r`` lives in slot ``t % P`` of block ``table(r)[t // P]`` (``P`` = block size).

Invariants (beyond the pool's):
    T1  ``len(table(r)) == ceil(length(r) / P)`` — a row owns exactly the blocks its tokens need.
    T2  a block's ref count equals the number of table entries that hold it.
    T3  a row writes only into blocks that are ``pool.is_writable`` — shared or cached blocks are copied
        first, so a write never changes what another row (or a future prefix hit) reads.
    T4  ``hashes(r)[i]`` is the chained hash of the first ``i + 1`` blocks of row ``r``'s known tokens,
        and ``table(r)[i]`` holds exactly those tokens' K/V.
"""

from __future__ import annotations

from collections.abc import Sequence

from .block_pool import BlockPool, OutOfBlocksError
from .prefix_hash import block_hashes, root_hash


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class BlockTables:
    """The block tables of all rows of one cache, plus what each row's prefix hashes need."""

    def __init__(self, pool: BlockPool, enable_prefix_caching: bool = False, salt: str | None = None):
        self.pool = pool
        self.block_size = pool.block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.salt = salt  # default tenant salt of new rows; set_tokens() may give a row its own
        self._tables: list[list[int]] = []
        self._lengths: list[int] = []
        self._tokens: list[list[int]] = []  # known token ids per row; may run ahead of the length
        self._padding: list[list[bool]] = []  # per known token: True where the column is left padding
        self._hashes: list[list[bytes]] = []
        self._salts: list[str | None] = []
        self.prefix_queried_blocks = 0
        self.prefix_hit_blocks = 0

    # ---- queries -------------------------------------------------------------------------------
    @property
    def num_rows(self) -> int:
        return len(self._tables)

    def table(self, row: int) -> list[int]:
        return list(self._tables[row])

    def length(self, row: int) -> int:
        return self._lengths[row]

    def hashes(self, row: int) -> list[bytes]:
        return list(self._hashes[row])

    def tables(self) -> list[list[int]]:
        return [list(t) for t in self._tables]

    def blocks_needed(self, row: int, new_length: int) -> int:
        """Fresh blocks that growing ``row`` to ``new_length`` takes, copy-on-write included."""
        length, table = self._lengths[row], self._tables[row]
        needed = max(0, _ceil_div(new_length, self.block_size) - len(table))
        if new_length > length and length % self.block_size and not self.pool.is_writable(table[-1]):
            needed += 1
        return needed

    # ---- row lifecycle -------------------------------------------------------------------------
    def add_rows(self, n: int) -> None:
        for _ in range(n):
            self._tables.append([])
            self._lengths.append(0)
            self._tokens.append([])
            self._padding.append([])
            self._hashes.append([])
            self._salts.append(self.salt)

    def release_all(self) -> None:
        """Free every row's blocks (tail first); cached blocks stay in the prefix index."""
        for table in self._tables:
            self.pool.free(table)
        self._clear_rows()

    def _clear_rows(self) -> None:
        self._tables, self._lengths, self._tokens, self._padding, self._hashes = [], [], [], [], []
        self._salts = []

    def fork(self, row: int) -> int:
        """A new row sharing all of ``row``'s blocks (ref += 1 each); returns its index."""
        self.select([*range(self.num_rows), row])
        return self.num_rows - 1

    def select(self, indices: Sequence[int]) -> None:
        """Rebuild the rows as ``[row(i) for i in indices]`` — beam reorder, batch select, repeat.

        Shares blocks instead of copying them: new references are taken before old ones are dropped,
        so a block kept by any selected row is never freed in between.
        """
        for i in indices:
            if not 0 <= i < self.num_rows:
                raise IndexError(f"Row {i} does not exist (the cache has {self.num_rows} rows).")
        tables = [list(self._tables[i]) for i in indices]
        for table in tables:
            for block in table:
                self.pool.incref(block)
        for table in self._tables:
            self.pool.free(table)
        self._lengths = [self._lengths[i] for i in indices]
        self._tokens = [list(self._tokens[i]) for i in indices]
        self._padding = [list(self._padding[i]) for i in indices]
        self._hashes = [list(self._hashes[i]) for i in indices]
        self._salts = [self._salts[i] for i in indices]
        self._tables = tables

    # ---- growth and rollback -------------------------------------------------------------------
    def grow(self, new_lengths: Sequence[int]) -> list[tuple[int, int]]:
        """Give every row room for ``new_lengths[r]`` tokens; returns ``(src, dst)`` block copies to perform.

        All or nothing: if the pool cannot supply every block (copy-on-write included), raises
        ``OutOfBlocksError`` before touching any table.
        """
        if len(new_lengths) != self.num_rows:
            raise ValueError(f"grow() got {len(new_lengths)} lengths for {self.num_rows} rows.")
        needed = sum(self.blocks_needed(r, n) for r, n in enumerate(new_lengths))
        if needed > self.pool.num_free():
            raise OutOfBlocksError(needed, self.pool.num_free(), self.pool.num_blocks)
        copies, released = [], []
        for row, new_length in enumerate(new_lengths):
            copies += self._grow_row(row, new_length, released)
        for block in released:  # after all allocations, so no copy source is reallocated before it is read
            self.pool.decref(block)
        if self.enable_prefix_caching:
            for row in range(self.num_rows):
                self._register_full_blocks(row)
        return copies

    def _grow_row(self, row: int, new_length: int, released: list[int]) -> list[tuple[int, int]]:
        table, length = self._tables[row], self._lengths[row]
        if new_length < length:
            raise ValueError(f"grow() cannot shrink row {row} from {length} to {new_length}; use truncate().")
        copies = []
        if new_length > length and length % self.block_size and not self.pool.is_writable(table[-1]):
            (fresh,) = self.pool.allocate(1)  # copy-on-write of the shared / cached partial block
            copies.append((table[-1], fresh))
            released.append(table[-1])
            table[-1] = fresh
        missing = _ceil_div(new_length, self.block_size) - len(table)
        if missing > 0:
            table.extend(self.pool.allocate(missing))
        self._lengths[row] = new_length
        return copies

    def truncate(self, row: int, new_length: int) -> None:
        """Roll ``row`` back to its first ``new_length`` tokens, freeing the blocks past them."""
        if not 0 <= new_length <= self._lengths[row]:
            raise ValueError(f"truncate() to {new_length} tokens is outside row {row}'s 0..{self._lengths[row]}.")
        table = self._tables[row]
        keep = _ceil_div(new_length, self.block_size)
        self.pool.free(table[keep:])
        del table[keep:]
        self._lengths[row] = new_length
        del self._tokens[row][new_length:]
        del self._padding[row][new_length:]
        del self._hashes[row][new_length // self.block_size:]

    # ---- prefix caching ------------------------------------------------------------------------
    def set_tokens(self, row: int, token_ids: Sequence[int], padding: Sequence[bool] | None = None,
                   salt: str | None = None) -> None:
        """Declare the token ids row ``row`` holds / will hold (enables hashing its full blocks).

        ``salt`` overrides the tables' default tenant salt for this row (a per-request ``cache_salt``).
        """
        if self._lengths[row] > 0:
            raise ValueError("set_tokens() must be called on an empty row (before its first token is stored).")
        if salt is not None:
            root_hash(salt)  # validates it
            self._salts[row] = salt
        self._tokens[row] = list(token_ids)
        self._padding[row] = list(padding) if padding is not None else [False] * len(token_ids)

    def extend_tokens(self, row: int, token_ids: Sequence[int], padding: Sequence[bool] | None = None) -> None:
        """Declare more of ``row``'s token ids (e.g. generated ones) and index its newly hashable full blocks."""
        known = self._tokens[row]
        if list(token_ids[: len(known)]) != known:
            raise ValueError(f"Row {row}: the given token ids do not start with the {len(known)} ids it already holds.")
        pads = list(padding or [])[: len(token_ids)]
        pads += [False] * (len(token_ids) - len(pads))  # e.g. a prompt mask: generated columns are not padding
        extra = pads[len(known):]
        self._tokens[row] = list(token_ids)
        self._padding[row] = self._padding[row] + extra
        if self.enable_prefix_caching:
            self._register_full_blocks(row)

    def match_prefix(self, row: int, max_tokens: int) -> tuple[list[int], list[bytes]]:
        """Cached blocks holding the longest full-block prefix of ``row``'s tokens, up to ``max_tokens``."""
        usable = min(max_tokens, len(self._tokens[row]))
        hashes = block_hashes(
            self._tokens[row][:usable], self.block_size, self._padding[row][:usable], salt=self._salts[row]
        )
        blocks = []
        for block_hash in hashes:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            blocks.append(block)
        self.prefix_queried_blocks += len(hashes)
        return blocks, hashes[: len(blocks)]

    def attach(self, row: int, blocks: Sequence[int], hashes: Sequence[bytes]) -> None:
        """Start an empty row with cached prefix ``blocks`` (shared: ref += 1)."""
        if self._tables[row]:
            raise ValueError(f"attach() needs an empty row; row {row} already holds {self._lengths[row]} tokens.")
        for block in blocks:
            self.pool.incref(block)
        self._tables[row] = list(blocks)
        self._lengths[row] = len(blocks) * self.block_size
        self._hashes[row] = list(hashes[: len(blocks)])
        self.prefix_hit_blocks += len(blocks)

    def _register_full_blocks(self, row: int) -> None:
        """Hash and index the row's newly completed blocks whose tokens are known (T4)."""
        done = self._hashes[row]
        full = min(self._lengths[row], len(self._tokens[row])) // self.block_size
        if full <= len(done):
            return
        new = block_hashes(
            self._tokens[row][: full * self.block_size], self.block_size, self._padding[row], salt=self._salts[row],
            start=len(done), parent=done[-1] if done else None,
        )
        for index, block_hash in enumerate(new, start=len(done)):
            block = self._tables[row][index]
            if self.pool.block_hash(block) is None:
                self.pool.cache_block(block, block_hash)
            done.append(block_hash)
