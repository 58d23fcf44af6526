"""Block pool and block tables: exact block ids and ref counts for scripted sequences, copy-on-write,
salted prefix hashes, exhaustion, and a hypothesis state machine over every operation."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hf_kvspec.cache.block_pool import BlockPool, OutOfBlocksError
from hf_kvspec.cache.block_table import BlockTables
from hf_kvspec.cache.prefix_hash import block_hashes


def refs(pool: BlockPool) -> list[int]:
    return [pool.ref_count(b) for b in range(pool.num_blocks)]


# ---- scripted sequences: exact ids ----------------------------------------------------------------
def test_allocate_free_order_is_fifo_and_tail_first():
    pool = BlockPool(num_blocks=6, block_size=4)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.free_queue() == [3, 4, 5]
    pool.free([0, 1, 2])  # a row's blocks go back tail first: its prefix is evicted last
    assert pool.free_queue() == [3, 4, 5, 2, 1, 0]
    assert pool.allocate(4) == [3, 4, 5, 2]
    assert (pool.num_free(), pool.num_used()) == (2, 4)


def test_copy_on_write_ref_counts_and_sharing():
    """Seed check (f): fork shares every block, a write into a shared partial block copies it first."""
    pool = BlockPool(num_blocks=8, block_size=4)
    tables = BlockTables(pool)
    tables.add_rows(1)
    assert tables.grow([10]) == []
    assert tables.table(0) == [0, 1, 2]
    assert tables.fork(0) == 1
    assert tables.table(1) == [0, 1, 2] and refs(pool)[:3] == [2, 2, 2]

    copies = tables.grow([10, 11])  # row 1 writes token 10 into shared block 2 (2 of 4 slots used)
    assert copies == [(2, 3)]
    assert tables.table(0) == [0, 1, 2] and tables.table(1) == [0, 1, 3]
    assert refs(pool)[:4] == [2, 2, 1, 1]

    assert tables.grow([12, 11]) == []  # row 0 now owns block 2 alone: writes in place
    assert tables.table(0) == [0, 1, 2]

    tables.truncate(1, 4)  # frees blocks 3 then 1's second reference
    assert tables.table(1) == [0] and refs(pool)[:4] == [2, 1, 1, 0]
    assert pool.free_queue() == [4, 5, 6, 7, 3]

    tables.select([0, 0])  # beam search keeps row 0 twice: shared, no copy
    assert tables.tables() == [[0, 1, 2], [0, 1, 2]] and refs(pool)[:4] == [2, 2, 2, 0]

    tables.release_all()
    assert pool.free_queue() == [4, 5, 6, 7, 3, 2, 1, 0] and refs(pool) == [0] * 8


def test_out_of_blocks_is_atomic():
    pool = BlockPool(num_blocks=2, block_size=4)
    tables = BlockTables(pool)
    tables.add_rows(2)
    tables.grow([4, 0])
    with pytest.raises(OutOfBlocksError) as info:
        tables.grow([8, 5])  # needs 1 + 2 blocks, 1 free
    assert (info.value.needed, info.value.free, info.value.total) == (3, 1, 2)
    assert "num_blocks" in str(info.value)
    assert tables.tables() == [[0], []] and pool.num_free() == 1  # nothing half-allocated
    with pytest.raises(ValueError, match="Double free"):
        pool.free([1])


# ---- prefix caching ---------------------------------------------------------------------------------
def test_hashes_are_chained_salted_and_padding_aware():
    tokens = list(range(12))
    assert block_hashes(tokens, 4) == block_hashes(tokens, 4)
    assert len(block_hashes(tokens[:11], 4)) == 2  # only full blocks
    assert block_hashes(tokens, 4, salt="a") != block_hashes(tokens, 4, salt="b")
    # same second block, different first block: the chain makes the second hash differ too
    other = [99, *tokens[1:]]
    assert block_hashes(other, 4)[1] != block_hashes(tokens, 4)[1]
    padded = block_hashes(tokens, 4, padding=[True] + [False] * 11)
    assert padded[0] != block_hashes(tokens, 4)[0]
    assert block_hashes(tokens, 4, start=1, parent=block_hashes(tokens, 4)[0]) == block_hashes(tokens, 4)[1:]


def _prefill(tables: BlockTables, tokens: list[int]) -> int:
    tables.add_rows(1)
    row = tables.num_rows - 1
    tables.set_tokens(row, tokens)
    blocks, hashes = tables.match_prefix(row, len(tokens) - 1)
    tables.attach(row, blocks, hashes)
    tables.grow([tables.length(r) if r != row else len(tokens) for r in range(tables.num_rows)])
    return len(blocks)


def test_prefix_hit_reuses_blocks_and_salt_isolates():
    pool = BlockPool(num_blocks=8, block_size=4)
    tables = BlockTables(pool, enable_prefix_caching=True)
    prompt = list(range(10))
    assert _prefill(tables, prompt) == 0
    assert pool.num_cached() == 2  # blocks 0 and 1 are full; block 2 holds 2 tokens
    tables.release_all()
    assert _prefill(tables, prompt) == 2
    assert tables.table(0)[:2] == [0, 1] and refs(pool)[:2] == [1, 1]
    assert tables.prefix_hit_blocks == 2

    salted = BlockTables(pool, enable_prefix_caching=True, salt="tenant-b")
    assert _prefill(salted, prompt) == 0  # same tokens, different salt: no sharing
    assert set(salted.table(0)).isdisjoint(tables.table(0))


def test_cached_blocks_are_evicted_lru_tail_first():
    pool = BlockPool(num_blocks=4, block_size=2)
    tables = BlockTables(pool, enable_prefix_caching=True)
    _prefill(tables, [1, 2, 3, 4, 5, 6, 7])  # blocks 0,1,2 full (cached), 3 partial
    tables.release_all()
    assert pool.free_queue() == [3, 2, 1, 0]
    pool.allocate(2)  # evicts block 3 (uncached) and block 2 (the prompt's last full block)
    assert pool.num_cached() == 2
    tables.add_rows(1)
    tables.set_tokens(0, [1, 2, 3, 4, 5, 6, 7])
    blocks, _ = tables.match_prefix(0, 6)
    assert blocks == [0, 1]


def test_writing_after_crop_into_a_cached_block_copies_it():
    pool = BlockPool(num_blocks=6, block_size=4)
    tables = BlockTables(pool, enable_prefix_caching=True)
    _prefill(tables, list(range(8)))  # blocks 0, 1 full and cached
    tables.truncate(0, 6)  # block 1 is now partial for the row but still cached for others
    assert tables.grow([7]) == [(1, 2)]
    assert tables.table(0) == [0, 2] and pool.block_hash(1) is not None and pool.ref_count(1) == 0


# ---- state machine ----------------------------------------------------------------------------------
NUM_BLOCKS, BLOCK = 7, 2
_fresh = iter(range(1000, 10**9))
_BASES = ([0] * 12, [1, 2, 3] * 4, [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3], [3, 1, 2, 0, 1, 2, 3, 0, 2, 1, 0, 3])


class PagedBookkeeping(RuleBasedStateMachine):
    """Shadow model: ``storage`` plays the page tensors (block -> slot values), ``rows`` each row's tokens.

    After every step: reading each row through its table gives back its tokens (so copy-on-write never
    changed another row), pool counts and ref counts are consistent, and a cached block's content is the
    one its hash was computed from (cached blocks are immutable; equal hashes mean equal tokens).
    """

    def __init__(self):
        super().__init__()
        self.pool = BlockPool(NUM_BLOCKS, BLOCK)
        self.tables = BlockTables(self.pool, enable_prefix_caching=True)
        self.storage: dict[int, list] = {b: [None] * BLOCK for b in range(NUM_BLOCKS)}
        self.rows: list[list[int]] = []  # tokens stored per row
        self.known: list[list[int]] = []  # tokens declared per row (prompt), may run ahead of `rows`
        self.content_of_hash: dict[bytes, tuple] = {}

    # prompts cut from a few shared bases, so that prefix hits (and evictions of cached blocks) are common
    @rule(prompt=st.builds(lambda base, cut: base[:cut], st.sampled_from(_BASES), st.integers(0, 12)))
    def add_row(self, prompt):
        self.tables.add_rows(1)
        row = self.tables.num_rows - 1
        self.tables.set_tokens(row, prompt)
        blocks, hashes = self.tables.match_prefix(row, max(0, len(prompt) - 1))
        self.tables.attach(row, blocks, hashes)
        self.rows.append(prompt[: len(blocks) * BLOCK])
        self.known.append(list(prompt))
        assert self._read(row) == self.rows[row]  # a prefix hit serves exactly the prompt's tokens

    @rule(prompt=st.sampled_from(_BASES))
    def other_tenant_never_hits(self, prompt):
        """Same tokens under another salt: no hit; under the same (default) salt: the same hashes."""
        other = BlockTables(self.pool, enable_prefix_caching=True, salt="other-tenant")
        other.add_rows(1)
        other.set_tokens(0, prompt)
        assert other.match_prefix(0, len(prompt)) == ([], [])
        same = BlockTables(self.pool, enable_prefix_caching=True)
        same.add_rows(1)
        same.set_tokens(0, prompt)
        _, hashes = same.match_prefix(0, len(prompt))
        assert hashes == block_hashes(prompt, BLOCK)[: len(hashes)]

    @precondition(lambda self: self.rows)
    @rule(data=st.data(), count=st.integers(1, 5))
    def append(self, data, count):
        row = data.draw(st.integers(0, len(self.rows) - 1))
        start = len(self.rows[row])
        lengths = [len(r) for r in self.rows]
        lengths[row] += count
        before = (self.tables.tables(), list(map(self.pool.ref_count, range(NUM_BLOCKS))))
        # T3: a write lands in a fresh block or in one this row owned alone and uncached before the step
        # (grow() hashes blocks it completes, so writability is judged on the state before it)
        writable_before = {b for b in self.tables.table(row) if self.pool.is_writable(b)}
        try:
            copies = self.tables.grow(lengths)
        except OutOfBlocksError:
            assert before == (self.tables.tables(), list(map(self.pool.ref_count, range(NUM_BLOCKS))))
            return
        for src, dst in copies:
            self.storage[dst] = list(self.storage[src])
        known = self.known[row]
        values = [known[t] if t < len(known) else next(_fresh) for t in range(start, start + count)]
        table = self.tables.table(row)
        for t, value in zip(range(start, start + count), values):
            block = table[t // BLOCK]
            assert block in writable_before or block not in before[0][row]
            self.storage[block][t % BLOCK] = value
        self.rows[row] += values

    @precondition(lambda self: self.rows)
    @rule(data=st.data())
    def fork(self, data):
        row = data.draw(st.integers(0, len(self.rows) - 1))
        self.tables.fork(row)
        self.rows.append(list(self.rows[row]))
        self.known.append(list(self.known[row]))

    @precondition(lambda self: self.rows)
    @rule(data=st.data())
    def select(self, data):
        indices = data.draw(st.lists(st.integers(0, len(self.rows) - 1), max_size=4))
        self.tables.select(indices)
        self.rows = [list(self.rows[i]) for i in indices]
        self.known = [list(self.known[i]) for i in indices]

    @precondition(lambda self: self.rows)
    @rule(data=st.data())
    def truncate(self, data):
        row = data.draw(st.integers(0, len(self.rows) - 1))
        new_length = data.draw(st.integers(0, len(self.rows[row])))
        self.tables.truncate(row, new_length)
        del self.rows[row][new_length:]
        del self.known[row][new_length:]

    @precondition(lambda self: self.rows)
    @rule(data=st.data())
    def drop_row(self, data):
        row = data.draw(st.integers(0, len(self.rows) - 1))
        keep = [r for r in range(len(self.rows)) if r != row]
        self.tables.select(keep)
        self.rows = [self.rows[r] for r in keep]
        self.known = [self.known[r] for r in keep]

    @rule()
    def release_all(self):
        self.tables.release_all()
        self.rows, self.known = [], []

    def _read(self, row: int) -> list:
        table = self.tables.table(row)
        return [self.storage[table[t // BLOCK]][t % BLOCK] for t in range(self.tables.length(row))]

    @invariant()
    def pool_counts_are_consistent(self):
        free = self.pool.free_queue()
        assert len(free) == len(set(free)) == self.pool.num_free()
        assert self.pool.num_free() + self.pool.num_used() == NUM_BLOCKS
        holders = [0] * NUM_BLOCKS
        for row in range(self.tables.num_rows):
            table = self.tables.table(row)
            assert len(table) == -(-self.tables.length(row) // BLOCK)
            for block in table:
                holders[block] += 1
        assert holders == [self.pool.ref_count(b) for b in range(NUM_BLOCKS)]
        assert all(self.pool.ref_count(b) == 0 for b in free)

    @invariant()
    def rows_read_back_their_tokens(self):
        for row in range(self.tables.num_rows):
            assert self._read(row) == self.rows[row]

    @invariant()
    def cached_blocks_are_immutable(self):
        for row in range(self.tables.num_rows):
            for index, block_hash in enumerate(self.tables.hashes(row)):
                content = tuple(self.rows[row][index * BLOCK:(index + 1) * BLOCK])
                assert self.content_of_hash.setdefault(block_hash, content) == content
        for block in range(NUM_BLOCKS):
            block_hash = self.pool.block_hash(block)
            if block_hash is not None and block_hash in self.content_of_hash:
                assert tuple(self.storage[block]) == self.content_of_hash[block_hash]
                assert self.pool.lookup(block_hash) == block


PagedBookkeeping.TestCase.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)
test_paged_bookkeeping_state_machine = PagedBookkeeping.TestCase
