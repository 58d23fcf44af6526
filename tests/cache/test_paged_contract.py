"""PagedCache against the cache contract (C1-C6 in ``hf_kvspec.cache``): per-layer lengths, ``crop_layers``,
``keep_positions`` with copy-on-write, the channel hand-over, the page-dtype promise, and a hypothesis state
machine comparing every layer bit for bit with a plain-tensor reference after every step."""

from __future__ import annotations

import itertools
from typing import ClassVar

import pytest
import torch
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from hf_kvspec import stored_kv
from hf_kvspec.attention.paged import ATTN_NAME, register_paged_attention, unregister_paged_attention
from hf_kvspec.cache.block_pool import BlockPool, OutOfBlocksError
from hf_kvspec.cache.block_table import BlockTables
from hf_kvspec.cache.paged import PagedCache
from hf_kvspec.cache.prefix_hash import block_hashes
from hf_kvspec.stored_kv import PagedKV
from tests.tiny_models import tiny_config, tiny_model

LAYERS, HEADS, DIM = 3, 2, 4  # the contract tests drive the cache directly: [B, HEADS, T, DIM] K/V per layer


def config(**overrides):
    return tiny_config("llama", num_hidden_layers=LAYERS, num_key_value_heads=HEADS, num_attention_heads=HEADS,
                       hidden_size=HEADS * DIM, **overrides)


def stored(cache: PagedCache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What layer ``layer`` holds, read through the block tables: K, V ``[B, Hkv, S, D]``."""
    rows = cache.tables.num_rows
    if not cache.layers[layer].is_initialized:
        empty = torch.empty(rows, HEADS, 0, DIM)
        return empty, empty
    tables = torch.tensor(cache.tables.tables(), dtype=torch.long).view(rows, -1)
    return cache.layers[layer].gather(PagedKV(tables, cache.get_seq_length(layer)))


def kv(batch: int, tokens: int, offset: float) -> torch.Tensor:
    """Distinct, exactly representable values [B, H, T, D] (so equality checks are bit-exact)."""
    return torch.arange(batch * HEADS * tokens * DIM, dtype=torch.float32).view(batch, HEADS, tokens, DIM) + offset


def assert_holds(cache: PagedCache, layer: int, expected: torch.Tensor) -> None:
    keys, values = stored(cache, layer)
    assert cache.get_seq_length(layer) == expected.shape[2]
    assert torch.equal(keys, expected) and torch.equal(values, -expected)


def refs_match_tables(cache: PagedCache) -> None:
    """T1/T2: each row owns ceil(longest layer / P) blocks; ref counts equal the table entries holding a block."""
    pool, tables = cache.pool, cache.tables
    extent = max(cache.get_seq_length(i) for i in range(len(cache.layers)))
    holders = [0] * pool.num_blocks
    for row in range(tables.num_rows):
        assert len(tables.table(row)) == -(-extent // cache.block_size)
        for block in tables.table(row):
            holders[block] += 1
    assert holders == [pool.ref_count(b) for b in range(pool.num_blocks)]
    assert pool.num_free() + pool.num_used() == pool.num_blocks


# ---- the bookkeeping under several writers (block_table.py): exact block ids --------------------------------
def test_prepare_writes_copies_every_shared_block_a_span_touches():
    pool = BlockPool(num_blocks=8, block_size=4)
    tables = BlockTables(pool)
    tables.add_rows(1)
    assert tables.prepare_writes([(0, 10)]) == []
    assert (tables.table(0), tables.length(0), tables.sealed(0)) == ([0, 1, 2], 10, 0)  # not sealed: no writer done
    tables.fork(0)
    # row 1 rewrites tokens 5, 6 (a writer cropped back into block 1): block 1 is copied, block 2 stays shared
    assert tables.prepare_writes([(10, 10), (5, 7)]) == [(1, 3)]
    assert tables.tables() == [[0, 1, 2], [0, 3, 2]] and [pool.ref_count(b) for b in range(4)] == [2, 1, 2, 1]
    assert tables.prepare_writes([(10, 13), (10, 10)]) == [(2, 4)]  # past the extent: shared partial block copied
    assert tables.tables() == [[0, 1, 4, 5], [0, 3, 2]] and tables.length(0) == 13
    with pytest.raises(OutOfBlocksError):
        tables.prepare_writes([(0, 13), (0, 13)])  # 2 copies of block 0 and a new tail block, 2 free: no change
    assert tables.tables() == [[0, 1, 4, 5], [0, 3, 2]]
    with pytest.raises(ValueError, match="start inside them"):
        tables.prepare_writes([(14, 15), (0, 0)])


def test_seal_hashes_only_complete_blocks_and_unseal_forgets_changed_ones():
    pool = BlockPool(num_blocks=8, block_size=2)
    tables = BlockTables(pool, enable_prefix_caching=True)
    tables.add_rows(1)
    tables.set_tokens(0, [1, 2, 3, 4, 5])
    tables.prepare_writes([(0, 5)])
    assert pool.num_cached() == 0
    tables.seal(0, 3)
    assert tables.hashes(0) == block_hashes([1, 2], 2)
    tables.seal(0, 5)
    assert tables.hashes(0) == block_hashes([1, 2, 3, 4], 2) and pool.num_cached() == 2
    tables.unseal(0, 3)  # tokens 3.. will be rewritten: the row stops claiming block 1, the pool keeps it
    assert tables.hashes(0) == block_hashes([1, 2], 2) and tables.sealed(0) == 3 and pool.num_cached() == 2
    assert tables.prepare_writes([(3, 4)]) == [(1, 3)]  # the cached block is copied before the rewrite


def test_prepare_moves_copies_destinations_and_reads_sources_from_the_copies():
    pool = BlockPool(num_blocks=8, block_size=2)
    tables = BlockTables(pool)
    tables.add_rows(1)
    tables.grow([6])
    tables.fork(0)  # both rows: [0, 1, 2]
    copies, moves, first_changed = tables.prepare_moves(1, [[1, 3], [0, 1]])  # row 0: 2 -> 1, 4 -> 2
    assert copies == [(0, 3), (1, 4)] and tables.tables() == [[3, 4, 2], [0, 1, 2]]
    # (src slot, dst slot): slot 8 is read by the first move and written by the second, so the tensor side
    # gathers every source before writing any destination
    assert moves == [(8, 7), (4, 8)] and first_changed == [1, None]


# ---- C2/C3: per-layer lengths -----------------------------------------------------------------------------
def test_layers_keep_their_own_lengths_and_crop_layers_frees_only_unneeded_blocks():
    cache = PagedCache(config(), block_size=4, num_blocks=16)
    prompt = kv(2, 6, 0.0)
    for layer in range(LAYERS):
        cache.update(prompt, -prompt, layer)
    drafts = kv(2, 3, 1000.0)  # self-speculation: draft tokens through the first layers only
    cache.update(drafts, -drafts, 0)
    keys, _ = cache.update(drafts[:, :, :1], -drafts[:, :, :1], 1)
    assert [cache.get_seq_length(i) for i in range(LAYERS)] == [9, 7, 6]
    assert torch.equal(keys, torch.cat([prompt, drafts[:, :, :1]], 2))  # returned K/V: the layer's own length
    assert cache.num_used_blocks() == 2 * 3  # one table per row, sized to the longest layer
    late = kv(2, 2, 2000.0)
    cache.update(late, -late, 2)  # the last layer writes inside the extent: no new block
    assert cache.num_used_blocks() == 6
    cache.crop_layers(6, [0])  # layer 0 back to 6: layers 1, 2 still need block 1
    assert [cache.get_seq_length(i) for i in range(LAYERS)] == [6, 7, 8]
    assert cache.num_used_blocks() == 2 * 2
    cache.crop(-3)  # every layer from its own length
    assert [cache.get_seq_length(i) for i in range(LAYERS)] == [3, 4, 5]
    assert cache.num_used_blocks() == 2 * 2
    assert_holds(cache, 0, prompt[:, :, :3])
    assert_holds(cache, 1, prompt[:, :, :4])
    assert_holds(cache, 2, torch.cat([prompt, late], 2)[:, :, :5])
    cache.crop_layers(4, [2])
    assert cache.num_used_blocks() == 2 * 1
    refs_match_tables(cache)
    with pytest.raises(ValueError, match=r"pass a length in 0..3"):
        cache.crop_layers(4, [0, 1])  # layer 0 holds 3: refused before layer 1 changes
    assert cache.get_seq_length(1) == 4
    with pytest.raises(ValueError, match="do not exist"):
        cache.crop_layers(0, [LAYERS])


def test_a_layer_cropped_into_a_shared_block_copies_it_before_writing():
    cache = PagedCache(config(), block_size=4, num_blocks=16)
    prompt = kv(1, 6, 0.0)
    for layer in range(LAYERS):
        cache.update(prompt, -prompt, layer)
    cache.batch_repeat_interleave(2)  # both rows share blocks [0, 1]
    cache.crop_layers(5, [1])  # layer 1 of both rows back into the shared block 1
    new = torch.cat([kv(1, 1, 500.0), kv(1, 1, 600.0)])  # rows write different tokens at position 5
    cache.update(new, -new, 1)
    assert cache.block_table(0) != cache.block_table(1)  # each row writes its own copy, not the shared block
    for row in range(2):
        expected = torch.cat([prompt[0, :, :5], new[row]], 1)
        assert torch.equal(stored(cache, 1)[0][row], expected)
        assert torch.equal(stored(cache, 0)[0][row], prompt[0])  # the other layers' slots came along with the copy
    refs_match_tables(cache)


# ---- C4: keep_positions -------------------------------------------------------------------------------------
def test_keep_positions_moves_each_rows_own_path_and_frees_the_tail():
    cache = PagedCache(config(), block_size=4, num_blocks=16)
    prefix, tree = kv(3, 3, 0.0), kv(3, 6, 100.0)  # segment of 6 tree nodes per row after 3 prefix tokens
    for layer in range(LAYERS):
        cache.update(prefix, -prefix, layer)
        cache.update(tree, -tree, layer)
    assert cache.num_used_blocks() == 3 * 3
    indices = torch.tensor([[0, 2, 5], [1, 3, 3], [0, 1, 2]])  # row 1 keeps 2 (hole repeats), row 2 a chain
    cache.keep_positions(3, indices)
    kept = torch.gather(tree, 2, indices[:, None, :, None].expand(3, HEADS, 3, DIM))
    for layer in range(LAYERS):
        assert_holds(cache, layer, torch.cat([prefix, kept], 2))
    assert cache.num_used_blocks() == 3 * 2  # 6 tokens: the third block of every row went back to the pool
    refs_match_tables(cache)


def test_keep_positions_on_some_layers_only():
    cache = PagedCache(config(), block_size=2, num_blocks=32)
    segment = kv(1, 5, 0.0)
    for layer in range(LAYERS):
        cache.update(segment, -segment, layer)
    cache.keep_positions(1, torch.tensor([[3, 1]]), layers=[0, 2])
    assert [cache.get_seq_length(i) for i in range(LAYERS)] == [3, 5, 3]
    assert_holds(cache, 0, segment[:, :, [0, 4, 2]])
    assert_holds(cache, 1, segment)
    assert cache.num_used_blocks() == 3  # layer 1 still needs all 5 tokens


def test_keep_positions_inside_a_shared_prefix_block_copies_it_first():
    """A segment starting inside a block shared with another row (and cached for prefix reuse): the moving
    row copies the block first; the other row and a later prefix hit still read the original slots."""
    cache = PagedCache(config(), block_size=4, num_blocks=32, enable_prefix_caching=True)
    prompt = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12, 13]])
    assert cache.load_prefix(prompt) == 0
    content = kv(1, 9, 0.0)
    for layer in range(LAYERS):
        cache.update(content, -content, layer)
    shared = cache.block_table(0)[1]  # block 1 holds tokens 4..7: full, hashed and cached
    assert cache.pool.block_hash(shared) is not None and not cache.pool.is_writable(shared)
    cache.batch_repeat_interleave(2)
    cache.keep_positions(5, torch.tensor([[1, 2, 3], [0, 1, 2]]))  # row 0 moves 6..8 -> 5..7; row 1 keeps its head
    assert cache.block_table(0)[1] != shared and cache.block_table(1)[1] == shared
    assert torch.equal(stored(cache, 2)[0][0], content[0, :, [0, 1, 2, 3, 4, 6, 7, 8]])
    assert torch.equal(stored(cache, 2)[0][1], content[0, :, :8])
    # T4: row 0's block 1 now holds other tokens, so the row stops claiming its hash; row 1 keeps both
    assert cache.tables.hashes(0) == cache.tables.hashes(1)[:1] and len(cache.tables.hashes(1)) == 2
    cache.reset()
    assert cache.load_prefix(prompt) == 8  # the cached blocks are intact: a new request reuses both
    for layer in range(LAYERS):
        assert_holds(cache, layer, content[:, :, :8])


@pytest.mark.parametrize("bad, match", [
    (dict(indices=torch.tensor([[0.0, 1.0]])), "integer tensor"),
    (dict(indices=torch.tensor([0, 1])), "integer tensor"),
    (dict(indices=torch.tensor([[0, 1], [0, 1]])), "one row of indices per cache row"),
    (dict(indices=torch.tensor([[0, 4]])), r"indices must lie in 0..3"),
    (dict(indices=torch.tensor([[0, 1, 2, 3, 3]])), "cannot keep 5 positions"),
    (dict(start=9), "start=9"),
    (dict(layers=[0, 7]), "do not exist"),
])
def test_keep_positions_refuses_bad_arguments_before_changing_anything(bad, match):
    cache = PagedCache(config(), block_size=2, num_blocks=16)
    content = kv(1, 6, 0.0)
    for layer in range(LAYERS):
        cache.update(content, -content, layer)
    args = dict(start=2, indices=torch.tensor([[1, 3]]), layers=None) | bad
    with pytest.raises(ValueError, match=match):
        cache.keep_positions(args["start"], args["indices"], args["layers"])
    for layer in range(LAYERS):
        assert_holds(cache, layer, content)


def test_keep_positions_out_of_blocks_changes_nothing():
    cache = PagedCache(config(), block_size=2, num_blocks=3)
    content = kv(1, 6, 0.0)
    for layer in range(LAYERS):
        cache.update(content, -content, layer)
    cache.batch_repeat_interleave(2)  # all 3 blocks shared, none free: moving into one needs a copy
    with pytest.raises(OutOfBlocksError):
        cache.keep_positions(0, torch.tensor([[1, 2], [0, 1]]))
    for layer in range(LAYERS):
        assert_holds(cache, layer, content.expand(2, -1, -1, -1))


# ---- T5: only blocks every layer has written are hashed -------------------------------------------------------
def test_blocks_are_hashed_only_once_every_layer_wrote_them():
    cache = PagedCache(config(), block_size=4, num_blocks=16, enable_prefix_caching=True)
    cache.load_prefix(torch.tensor([list(range(10, 19))]))
    content = kv(1, 9, 0.0)
    for layer in range(LAYERS - 1):
        cache.update(content, -content, layer)
    assert cache.pool.num_cached() == 0  # the last layer has not written blocks 0, 1 yet
    cache.update(content, -content, LAYERS - 1)
    assert cache.pool.num_cached() == 2


# ---- C1 + the channel ---------------------------------------------------------------------------------------
def test_update_hands_pages_over_only_when_built_for_the_reader():
    """What ``update`` returns is fixed at construction: gathered K/V for a cache built under sdpa, whatever the
    model runs later; pages + PagedKV for one built under kvspec_paged, which refuses a model switched away."""
    model = tiny_model("llama", attn_implementation="sdpa")
    dense = PagedCache(model.config, block_size=4, num_blocks=8)
    content = torch.ones(1, 2, 3, 16)
    register_paged_attention()
    model.set_attn_implementation(ATTN_NAME)
    try:
        paged = PagedCache(model.config, block_size=4, num_blocks=8)
        kwargs: dict = {}
        keys, _ = dense.update(content, content, 0, kwargs=kwargs)  # built under sdpa: still gathered
        assert stored_kv.KWARG not in kwargs and keys.shape == (1, 2, 3, 16)
        assert (dense.paired_attention, paged.paired_attention) == (None, ATTN_NAME)
        paged.update(content[:, :, :2], content[:, :, :2], 1, kwargs=kwargs)
        keys, _ = paged.update(content[:, :, :1], content[:, :, :1], 0, kwargs=kwargs)
        handed = kwargs[stored_kv.KWARG]
        assert isinstance(handed, PagedKV) and handed.kv_length == 1  # layer 0's own length
        assert keys is paged.layers[0].keys  # the raw pages
    finally:
        model.set_attn_implementation("sdpa")
        unregister_paged_attention()
    with pytest.raises(ValueError, match="now runs 'sdpa'"):  # raw pages must never reach sdpa
        paged.update(content[:, :, :1], content[:, :, :1], 0, kwargs={})
    assert paged.get_seq_length(0) == 2  # the refusal comes after the write; the cache stays consistent
    keys, _ = paged.update(content[:, :, :1], content[:, :, :1], 1)  # no kwargs (outside a model): gathered
    assert keys.shape == (1, 2, 3, 16)


# ---- the page-dtype promise (issue 18, item 3) ------------------------------------------------------------------
def test_pages_keep_the_memory_budget_of_the_requested_dtype():
    model = tiny_model("llama")  # fp32
    budget = 64 * 1024
    cache = PagedCache(model.config, block_size=4, memory_budget=budget, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"dtype=torch.float32"):
        model(torch.tensor([[5, 6, 7]]), cache=cache)
    assert cache.nbytes() <= budget and cache.num_free_blocks() == cache.num_total_blocks()
    for dtype in (torch.float32, None):  # the model's dtype, or the config's by default
        cache = PagedCache(model.config, block_size=4, memory_budget=budget, dtype=dtype)
        model(torch.tensor([[5, 6, 7]]), cache=cache)
        assert 0 < cache.nbytes() <= budget


# ---- state machine ------------------------------------------------------------------------------------------
MAX_LEN = 32  # tokens per layer
_BASES = ([4] * 28, [5, 6, 7, 8] * 7, [4] * 9 + [9, 8, 7, 6, 5, 4, 3, 2, 1, 0] * 2)  # shared heads: prefix hits


def _content(tokens: tuple, layer: int) -> torch.Tensor:
    """K of the last of ``tokens`` at ``layer`` [H, D]: a function of the whole prefix, as a real model's is.
    Small integers times 32 plus a head/dim code: exact in fp32."""
    base = hash(tokens) % 4093
    return base * 32 + layer * 8 + torch.arange(HEADS * DIM, dtype=torch.float32).view(HEADS, DIM)


class PagedContract(RuleBasedStateMachine):
    """Reference: ``ref[l]`` ``[B, H, S_l, D]`` plain tensors (values are ``-keys``). Every rule applies the same
    edit to the cache and to the reference; after every step each layer reads back its reference bit for bit,
    ref counts match the tables and cached blocks never change."""

    BLOCK = 4

    def __init__(self):
        super().__init__()
        blocks_per_row = -(-MAX_LEN // self.BLOCK)
        self.cache = PagedCache(config(), block_size=self.BLOCK, num_blocks=2 * blocks_per_row + 2,
                                enable_prefix_caching=True)
        self.ref: list[torch.Tensor] | None = None  # None: the cache holds no rows
        self.fresh = itertools.count(1 << 13)  # unique values for generated tokens (prompt content stays below)
        self.cached_pages: dict[bytes, torch.Tensor] = {}

    # -- helpers
    @property
    def batch(self) -> int:
        return 0 if self.ref is None else self.ref[0].shape[0]

    def lengths(self) -> list[int]:
        return [0] * LAYERS if self.ref is None else [r.shape[2] for r in self.ref]

    def _write(self, layer: int, new: torch.Tensor) -> bool:
        try:
            self.cache.update(new, -new, layer)
        except OutOfBlocksError:
            event("out of blocks")
            return False
        self.ref[layer] = torch.cat([self.ref[layer], new], 2)
        return True

    def _generated(self, batch: int, tokens: int) -> torch.Tensor:
        """Content of generated tokens [B, H, T, D]: unique codes, above every prompt content value."""
        codes = torch.tensor([[next(self.fresh) for _ in range(tokens)] for _ in range(batch)], dtype=torch.float32)
        return codes.view(batch, 1, tokens, 1) * 32 + torch.arange(HEADS * DIM, dtype=torch.float32).view(1, HEADS, 1, DIM)

    # -- rules
    _prompt_args: ClassVar[dict] = dict(data=st.data(), rows=st.integers(1, 3), length=st.integers(1, 28),
                                        split=st.integers(0, LAYERS))

    @initialize(**_prompt_args)
    def first_request(self, data, rows, length, split):
        self.load_prompts(data, rows, length, split)

    @rule(**_prompt_args)
    def next_request(self, data, rows, length, split):
        self.load_prompts(data, rows, length, split)

    def load_prompts(self, data, rows, length, split):
        """A new request: prefix hits attach cached blocks, the rest of the prompt is prefilled in two layer
        ranges (``0..split-1`` first, as self-speculation writes), content a function of the prompt."""
        prompts = [data.draw(st.sampled_from(_BASES))[:length] for _ in range(rows)]
        skipped = self.cache.load_prefix(torch.tensor(prompts))
        assert skipped % self.BLOCK == 0 and skipped <= length - 1
        event("prefix hit" if skipped else "prefix miss")
        full = [torch.stack([torch.stack([_content(tuple(p[:t + 1]), layer) for t in range(length)], 1)
                             for p in prompts]) for layer in range(LAYERS)]  # per layer [B, H, length, D]
        self.ref = [f[:, :, :skipped] for f in full]
        for layers in (range(split), range(split, LAYERS)):
            for layer in layers:
                if not self._write(layer, full[layer][:, :, skipped:]):
                    self.reset()  # a request that does not fit is dropped, not finished with other content
                    return

    @rule(data=st.data(), tokens=st.integers(1, 5), lo=st.integers(0, LAYERS - 1))
    def append(self, data, tokens, lo):
        """A forward through layers ``lo..hi-1`` (all of them when ``lo == 0`` and ``hi == LAYERS``)."""
        hi = data.draw(st.integers(lo + 1, LAYERS))
        if max(self.lengths()) + tokens > MAX_LEN:
            return
        if self.ref is None:
            batch = data.draw(st.integers(1, 3))
            self.ref = [torch.empty(batch, HEADS, 0, DIM) for _ in range(LAYERS)]
        for layer in range(lo, hi):
            if not self._write(layer, self._generated(self.batch, tokens)):
                return

    @precondition(lambda self: self.ref is not None)
    @rule(tokens=st.integers(0, 6))
    def crop(self, tokens):
        self.cache.crop(-tokens)
        self.ref = [r[:, :, :max(0, r.shape[2] - tokens)] for r in self.ref]

    @precondition(lambda self: self.ref is not None)
    @rule(data=st.data(), lo=st.integers(0, LAYERS - 1))
    def crop_layers(self, data, lo):
        layers = range(lo, data.draw(st.integers(lo + 1, LAYERS)))
        length = data.draw(st.integers(0, min(self.lengths()[i] for i in layers)))
        self.cache.crop_layers(length, layers)
        for i in layers:
            self.ref[i] = self.ref[i][:, :, :length]

    @precondition(lambda self: self.ref is not None)
    @rule(data=st.data(), all_layers=st.booleans())
    def keep_positions(self, data, all_layers):
        layers = None if all_layers else data.draw(st.lists(st.integers(0, LAYERS - 1), min_size=1, unique=True))
        chosen = range(LAYERS) if layers is None else layers
        held = min(self.lengths()[i] for i in chosen)
        start = data.draw(st.integers(0, held))
        segment = held - start
        width = data.draw(st.integers(0, segment))
        rows = []
        for _ in range(self.batch):  # ascending kept positions, shorter rows padded by repeating one
            kept = sorted(data.draw(st.lists(st.integers(0, segment - 1), max_size=width, unique=True))) \
                if segment else []
            rows.append(kept + [kept[-1] if kept else 0] * (width - len(kept)))
        indices = torch.tensor(rows, dtype=torch.long).view(self.batch, width)
        before = self.cache.tables.tables()
        try:
            self.cache.keep_positions(start, indices, layers)
        except OutOfBlocksError:
            event("out of blocks")
            return
        copied = any(a != b for old, new in zip(before, self.cache.tables.tables()) for a, b in zip(old, new))
        event(f"keep_positions {'copied a block' if copied else 'copied nothing'}")
        index = indices[:, None, :, None].expand(self.batch, HEADS, width, DIM)
        for i in chosen:
            self.ref[i] = torch.cat([self.ref[i][:, :, :start], torch.gather(self.ref[i][:, :, start:], 2, index)], 2)

    @precondition(lambda self: self.ref is not None and self.batch > 0)
    @rule(data=st.data())
    def reorder(self, data):
        beams = torch.tensor(data.draw(st.lists(st.integers(0, self.batch - 1), min_size=self.batch,
                                                max_size=self.batch)))
        self.cache.reorder_cache(beams)
        self.ref = [r[beams] for r in self.ref]

    @precondition(lambda self: self.ref is not None and self.batch > 0)
    @rule(data=st.data())
    def batch_select(self, data):
        rows = torch.tensor(data.draw(st.lists(st.integers(0, self.batch - 1), min_size=1, max_size=3)))
        self.cache.batch_select_indices(rows)
        self.ref = [r[rows] for r in self.ref]

    @precondition(lambda self: self.ref is not None and 0 < self.batch <= 2)
    @rule(repeats=st.integers(1, 2))
    def repeat(self, repeats):
        self.cache.batch_repeat_interleave(repeats)
        self.ref = [r.repeat_interleave(repeats, dim=0) for r in self.ref]

    @rule()
    def reset(self):
        self.cache.reset()
        self.ref = None
        assert self.cache.num_free_blocks() == self.cache.num_total_blocks()

    # -- invariants
    @invariant()
    def layers_read_back_the_reference(self):
        if self.ref is None:
            assert all(self.cache.get_seq_length(i) == 0 for i in range(LAYERS))
            return
        for layer in range(LAYERS):
            assert_holds(self.cache, layer, self.ref[layer])

    @invariant()
    def bookkeeping_is_consistent(self):
        refs_match_tables(self.cache)
        free = self.cache.pool.free_queue()
        assert all(self.cache.pool.ref_count(b) == 0 for b in free)

    @invariant()
    def cached_blocks_never_change(self):
        pool = self.cache.pool
        if not all(layer.is_initialized for layer in self.cache.layers):
            return  # nothing is sealed before every layer has written
        for block in range(pool.num_blocks):
            block_hash = pool.block_hash(block)
            if block_hash is not None:
                pages = torch.stack([layer.keys[block] for layer in self.cache.layers])
                assert torch.equal(self.cached_pages.setdefault(block_hash, pages.clone()), pages)

    def teardown(self):
        self.cache.reset()
        pool = self.cache.pool
        assert pool.num_free() == pool.num_blocks and all(pool.ref_count(b) == 0 for b in range(pool.num_blocks))


_SETTINGS = settings(max_examples=40, stateful_step_count=25, deadline=None)


class PagedContractBlock1(PagedContract):
    BLOCK = 1


class PagedContractBlock3(PagedContract):
    BLOCK = 3


class PagedContractBlock16(PagedContract):
    BLOCK = 16


PagedContractBlock1.TestCase.settings = PagedContractBlock3.TestCase.settings = _SETTINGS
PagedContractBlock16.TestCase.settings = _SETTINGS
test_paged_contract_block_1 = PagedContractBlock1.TestCase
test_paged_contract_block_3 = PagedContractBlock3.TestCase
test_paged_contract_block_16 = PagedContractBlock16.TestCase
