"""Per-row block tables over a ``BlockPool``: grow, fork, select, truncate, copy-on-write, prefix attach.

Boundary: plain Python bookkeeping, no torch. It decides *which* physical block holds each logical
token and reports the block copies that copy-on-write needs; the tensor side (``paged.py``) performs
those copies and the actual K/V writes.

Token ``t`` of row ``r`` lives in slot ``t % P`` of block ``table(r)[t // P]`` (``P`` = block size).

Several writers may share one table (``PagedCache``'s layers, each at its own length). ``length(r)`` is
the table's extent (the longest writer); ``sealed(r)`` is how many leading tokens *every* writer has
stored. A single writer uses ``grow``, which seals what it grows; several writers call
``prepare_writes`` before each write and ``seal`` once the slowest writer has caught up.

Invariants (beyond the pool's):
    T1  ``len(table(r)) == ceil(length(r) / P)`` — a row owns exactly the blocks its tokens need.
    T2  a block's ref count equals the number of table entries that hold it.
    T3  a row writes only into blocks that are ``pool.is_writable`` — shared or cached blocks are copied
        first (``prepare_writes``, for any span, also one below the extent), so a write never changes
        what another row (or a future prefix hit) reads.
    T4  ``hashes(r)[i]`` is the chained hash of the first ``i + 1`` blocks of row ``r``'s known tokens,
        and ``table(r)[i]`` holds exactly those tokens' K/V.
    T5  ``sealed(r) <= length(r)`` and only blocks within the first ``sealed(r)`` tokens are hashed: a
        block some writer has not filled yet is never indexed (it would be served half-written).
        ``unseal(r, p)`` — called before positions from ``p`` on are rewritten or dropped — forgets the
        known token ids and the hashes of blocks reaching past ``p``; the pool keeps such a block's hash
        (its contents are intact: being cached, it is copied before any write), only the row stops
        claiming it.
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
        self._sealed: list[int] = []  # T5: leading tokens every writer has stored
        self._tokens: list[list[int]] = []  # known token ids per row; may run ahead of the length
        self._padding: list[list[bool]] = []  # per known token: True where the column is left padding
        self._hashes: list[list[bytes]] = []
        self._salts: list[str | None] = []
        self.prefix_queried_blocks = 0
        self.prefix_hit_blocks = 0
        self.version = 0  # bumped by every change to tables, lengths or hashes (callers cache index tensors)

    # ---- queries -------------------------------------------------------------------------------
    @property
    def num_rows(self) -> int:
        return len(self._tables)

    def table(self, row: int) -> list[int]:
        return list(self._tables[row])

    def length(self, row: int) -> int:
        return self._lengths[row]

    def sealed(self, row: int) -> int:
        return self._sealed[row]

    def hashes(self, row: int) -> list[bytes]:
        return list(self._hashes[row])

    def tables(self) -> list[list[int]]:
        return [list(t) for t in self._tables]

    def blocks_needed(self, row: int, new_length: int) -> int:
        """Fresh blocks that growing ``row`` to ``new_length`` takes, copy-on-write included."""
        return self._blocks_needed(row, self._lengths[row], new_length)

    def _blocks_needed(self, row: int, lo: int, hi: int) -> int:
        """Fresh blocks that writing tokens ``lo..hi-1`` of ``row`` takes: copies plus new tail blocks."""
        if hi <= lo:
            return 0
        return len(self._unwritable(row, lo, hi)) + max(0, _ceil_div(hi, self.block_size) - len(self._tables[row]))

    def _unwritable(self, row: int, lo: int, hi: int) -> list[int]:
        """Indices into ``table(row)`` of existing blocks overlapping tokens ``lo..hi-1`` that need a copy."""
        table = self._tables[row]
        last = min(_ceil_div(hi, self.block_size), len(table))
        return [i for i in range(lo // self.block_size, last) if not self.pool.is_writable(table[i])]

    # ---- row lifecycle -------------------------------------------------------------------------
    def add_rows(self, n: int) -> None:
        self.version += 1
        for _ in range(n):
            self._tables.append([])
            self._lengths.append(0)
            self._sealed.append(0)
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
        self._sealed, self._salts = [], []
        self.version += 1

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
        self._sealed = [self._sealed[i] for i in indices]
        self._tokens = [list(self._tokens[i]) for i in indices]
        self._padding = [list(self._padding[i]) for i in indices]
        self._hashes = [list(self._hashes[i]) for i in indices]
        self._salts = [self._salts[i] for i in indices]
        self._tables = tables
        self.version += 1

    # ---- growth and rollback -------------------------------------------------------------------
    def grow(self, new_lengths: Sequence[int]) -> list[tuple[int, int]]:
        """Give every row room for ``new_lengths[r]`` tokens; returns ``(src, dst)`` block copies to perform.

        For a single writer: the grown tokens count as stored (sealed) and newly full blocks are hashed.
        All or nothing: if the pool cannot supply every block (copy-on-write included), raises
        ``OutOfBlocksError`` before touching any table.
        """
        if len(new_lengths) != self.num_rows:
            raise ValueError(f"grow() got {len(new_lengths)} lengths for {self.num_rows} rows.")
        for row, new_length in enumerate(new_lengths):
            if new_length < self._lengths[row]:
                raise ValueError(f"grow() cannot shrink row {row} from {self._lengths[row]} to {new_length}; "
                                 "use truncate().")
        copies = self.prepare_writes([(self._lengths[r], n) for r, n in enumerate(new_lengths)])
        for row, new_length in enumerate(new_lengths):
            self.seal(row, new_length)
        return copies

    def prepare_writes(self, spans: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
        """Make tokens ``lo..hi-1`` of every row writable (``spans[r] = (lo, hi)``, ``lo <= length(r)``).

        Extends the table to ``hi`` when it is shorter and copies (T3) every existing block in the span that
        is shared or cached — also below the extent, e.g. for a writer cropped back into a shared block.
        Returns the ``(src, dst)`` copies the tensor side must perform, all rows' allocations first. All or
        nothing: raises ``OutOfBlocksError`` before any change.
        """
        if len(spans) != self.num_rows:
            raise ValueError(f"prepare_writes() got {len(spans)} spans for {self.num_rows} rows.")
        for row, (lo, _hi) in enumerate(spans):
            if not 0 <= lo <= self._lengths[row]:
                raise ValueError(f"prepare_writes(): row {row} holds {self._lengths[row]} tokens; a write must "
                                 f"start inside them or at their end, not at {lo}.")
        needed = sum(self._blocks_needed(row, lo, hi) for row, (lo, hi) in enumerate(spans))
        if needed > self.pool.num_free():
            raise OutOfBlocksError(needed, self.pool.num_free(), self.pool.num_blocks)
        copies, released = [], []
        for row, (lo, hi) in enumerate(spans):
            if hi > lo:
                copies += self._prepare_row(row, lo, hi, released)
        for block in released:  # after all allocations, so no copy source is reallocated before it is read
            self.pool.decref(block)
        if needed:
            self.version += 1
        return copies

    def _prepare_row(self, row: int, lo: int, hi: int, released: list[int]) -> list[tuple[int, int]]:
        table, copies = self._tables[row], []
        for index in self._unwritable(row, lo, hi):
            (fresh,) = self.pool.allocate(1)  # copy-on-write of a shared / cached block
            copies.append((table[index], fresh))
            released.append(table[index])
            table[index] = fresh
        missing = _ceil_div(hi, self.block_size) - len(table)
        if missing > 0:
            table.extend(self.pool.allocate(missing))
        self._lengths[row] = max(self._lengths[row], hi)
        return copies

    def prepare_moves(self, start: int, kept: Sequence[Sequence[int]]):
        """Plan ``keep_positions``: token ``start + kept[r][j]`` of row ``r`` moves to ``start + j``.

        Destination blocks are made writable first (T3; positions kept in place are not written, so they
        copy nothing). Returns ``(copies, moves, first_changed)``: the ``(src, dst)`` block copies to perform,
        the ``(src, dst)`` slot pairs to move afterwards, and per row the first position whose contents
        change (None when the row keeps its segment's head in place). All or nothing, like ``prepare_writes``.
        """
        positions = [[(start + i, start + j) for j, i in enumerate(row) if i != j] for row in kept]
        spans = [(row[0][1], row[-1][1] + 1) if row else (start, start) for row in positions]
        copies = self.prepare_writes(spans)
        moves = [(self._slot(r, src), self._slot(r, dst)) for r, row in enumerate(positions) for src, dst in row]
        return copies, moves, [row[0][1] if row else None for row in positions]

    def _slot(self, row: int, position: int) -> int:
        return self._tables[row][position // self.block_size] * self.block_size + position % self.block_size

    def truncate(self, row: int, new_length: int) -> None:
        """Roll ``row`` back to its first ``new_length`` tokens, freeing the blocks past them."""
        if not 0 <= new_length <= self._lengths[row]:
            raise ValueError(f"truncate() to {new_length} tokens is outside row {row}'s 0..{self._lengths[row]}.")
        table = self._tables[row]
        keep = _ceil_div(new_length, self.block_size)
        self.pool.free(table[keep:])
        del table[keep:]
        self._lengths[row] = new_length
        self.unseal(row, new_length)

    def unseal(self, row: int, position: int) -> None:
        """Tokens from ``position`` on will be rewritten or dropped: forget their ids and the row's hashes of
        blocks reaching past ``position`` (T4, T5). Cached blocks keep their pool hash: they are intact."""
        self._sealed[row] = min(self._sealed[row], position)
        del self._tokens[row][position:]
        del self._padding[row][position:]
        del self._hashes[row][position // self.block_size:]
        self.version += 1

    def seal(self, row: int, length: int) -> None:
        """Every writer now holds ``row``'s first ``length`` tokens: hash and index its newly full blocks."""
        if length > self._lengths[row]:
            raise ValueError(f"seal() of {length} tokens past row {row}'s {self._lengths[row]}.")
        if length > self._sealed[row]:
            self._sealed[row] = length
            if self.enable_prefix_caching:
                self._register_full_blocks(row)

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
        self._lengths[row] = self._sealed[row] = len(blocks) * self.block_size
        self._hashes[row] = list(hashes[: len(blocks)])
        self.prefix_hit_blocks += len(blocks)
        self.version += 1

    def _register_full_blocks(self, row: int) -> None:
        """Hash and index the row's newly completed blocks whose tokens are known (T4)."""
        done = self._hashes[row]
        full = min(self._sealed[row], len(self._tokens[row])) // self.block_size
        if full <= len(done):
            return
        self.version += 1  # cached blocks stop being writable
        new = block_hashes(
            self._tokens[row][: full * self.block_size], self.block_size, self._padding[row], salt=self._salts[row],
            start=len(done), parent=done[-1] if done else None,
        )
        for index, block_hash in enumerate(new, start=len(done)):
            block = self._tables[row][index]
            if self.pool.block_hash(block) is None:
                self.pool.cache_block(block, block_hash)
            done.append(block_hash)
