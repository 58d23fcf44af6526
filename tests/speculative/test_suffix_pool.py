"""The suffix pool: drafts equal a brute-force search over every stored position, tenants never read each other,
the accounted bytes are what the process holds and stay under the budget, eviction takes the least recently used,
save/load round-trips, and concurrent use keeps the books."""

from __future__ import annotations

import random
import threading
import tracemalloc

import pytest

from hf_kvspec.speculative import suffix_pool
from hf_kvspec.speculative.suffix_pool import MAX_MATCH, SuffixPool, tenant_of


def reference_draft(sequences: list[list[int]], context: list[int], depth_cap: int, min_prob: float,
                    spec_factor: float = 1.0) -> tuple[int, dict[tuple[int, ...], float]]:
    """(longest match, {path: prob}) by brute force: every position of every sequence (the context's own tail
    excluded), its match against the context's end, the continuations of the longest matches merged by prefix."""
    best, follows = 0, []
    for seq in sequences:
        for position in range(1, len(seq) + 1):
            follow = seq[position: position + depth_cap]
            if not follow:
                continue
            match = 0
            while (match < min(position, len(context), MAX_MATCH)
                   and seq[position - 1 - match] == context[-1 - match]):
                match += 1
            if match == 0:
                continue
            if match > best:
                best, follows = match, [follow]
            elif match == best:
                follows.append(follow)
    depth = min(depth_cap, int(spec_factor * best))
    counts: dict[tuple[int, ...], int] = {}
    for follow in follows:
        for end in range(1, min(depth, len(follow)) + 1):
            counts[tuple(follow[:end])] = counts.get(tuple(follow[:end]), 0) + 1
    return best, {path: n / len(follows) for path, n in counts.items() if n / len(follows) >= min_prob}


def paths(draft) -> dict[tuple[int, ...], float]:
    out = {}
    for node, (token, parent) in enumerate(zip(draft.tokens, draft.parents)):
        prefix = () if parent < 0 else next(p for p, n in _nodes(draft).items() if n == parent)
        out[(*prefix, token)] = draft.probs[node]
    return out


def _nodes(draft) -> dict[tuple[int, ...], int]:
    prefixes: dict[tuple[int, ...], int] = {}
    by_node = {}
    for node, (token, parent) in enumerate(zip(draft.tokens, draft.parents)):
        by_node[node] = (*(by_node[parent] if parent >= 0 else ()), token)
        prefixes[by_node[node]] = node
    return prefixes


@pytest.mark.parametrize("seed", range(40))
def test_drafts_equal_a_brute_force_search(seed):
    """Few occurrences per key (below SCAN and MAX_OCCURRENCES): the pool's draft is the exhaustive one."""
    rng = random.Random(seed)
    vocab = rng.choice([4, 6, 10])
    sequences = [[rng.randrange(vocab) for _ in range(rng.randint(3, 14))] for _ in range(rng.randint(1, 3))]
    context = [rng.randrange(vocab) for _ in range(rng.randint(1, 9))]
    pool = SuffixPool(share_unsalted=True)
    for seq in sequences:
        pool.add(seq)
    pool.update("ctx", context)
    draft = pool.propose("ctx", max_nodes=1000, max_depth=6, min_prob=0.2)
    match, expected = reference_draft([*sequences, context], context, 6, 0.2)
    assert draft.match == match
    assert paths(draft) == pytest.approx(expected)
    # best-first: parents come before children and no node is likelier than its parent
    for node, parent in enumerate(draft.parents):
        assert parent < node and (parent < 0 or draft.probs[parent] >= draft.probs[node])


def test_a_short_match_earns_a_short_draft_and_nodes_are_capped():
    pool = SuffixPool(share_unsalted=True)
    pool.add([1, 2, 3, 4, 5, 6, 7, 8, 9])
    pool.update("a", [9, 9, 2])  # matches "2" only: one draft token at spec_factor 1
    assert pool.propose("a", 8, 8).tokens == (3,)
    assert pool.propose("a", 8, 8, spec_factor=3.0).tokens == (3, 4, 5)
    pool.update("b", [0, 1, 2, 3, 4])  # matches 4 tokens
    assert pool.propose("b", 8, 8).tokens == (5, 6, 7, 8)
    assert pool.propose("b", 2, 8).tokens == (5, 6)
    assert pool.propose("b", 8, 3).tokens == (5, 6, 7)


def test_a_tree_holds_the_frequent_branches_and_a_chain_the_most_frequent():
    pool = SuffixPool(share_unsalted=True)
    for tail in ([7, 8], [7, 8], [7, 9], [5, 6]):
        pool.add([1, 2, 3, *tail])
    pool.update("q", [0, 1, 2, 3])
    draft = pool.propose("q", 8, 2, min_prob=0.2)
    assert paths(draft) == pytest.approx({(7,): 0.75, (7, 8): 0.5, (7, 9): 0.25, (5,): 0.25, (5, 6): 0.25})
    assert draft.chain().tokens == (7, 8) and draft.chain().is_chain
    assert draft.expected == pytest.approx(2.0)


def test_tenants_never_read_each_other():
    """Salt A's text is never proposed to salt B or to unsalted sequences; unsalted sequences share nothing
    unless the pool opts in."""
    pool = SuffixPool()
    pool.update("a1", [1, 2, 3, 100, 101, 102], salt="A")
    pool.release("a1")
    pool.update("u1", [1, 2, 3, 200, 201])
    pool.release("u1")  # unsalted, own tenant: dropped
    pool.update("b1", [1, 2, 3], salt="B")
    pool.update("u2", [1, 2, 3])
    assert pool.propose("b1", 8, 8).tokens == ()
    assert pool.propose("u2", 8, 8).tokens == ()
    pool.update("a2", [9, 1, 2, 3], salt="A")
    assert pool.propose("a2", 8, 8).tokens == (100, 101, 102)
    shared = SuffixPool(share_unsalted=True)
    shared.update("u1", [1, 2, 3, 200, 201])
    shared.release("u1")
    shared.update("u2", [1, 2, 3])
    assert shared.propose("u2", 8, 8).tokens == (200, 201)
    assert tenant_of("A", None, False) != tenant_of("B", None, False)
    assert "A" not in str(tenant_of("A", None, False))  # the salt is never stored


def test_accounted_bytes_are_what_the_process_holds():
    """``nbytes`` (a formula over counts) against tracemalloc's count of what the pool allocated: within 25%
    either way on text-like and on uniform token streams (a budget that under- or over-counts would be a lie)."""
    for vocab, zipf in ((49152, True), (49152, False)):
        rng = random.Random(0)
        tracemalloc.start()
        try:
            pool = SuffixPool(max_bytes=1 << 40, share_unsalted=True)
            before = tracemalloc.get_traced_memory()[0]
            for i in range(200):
                size = rng.randint(50, 400)
                tokens = [min(int(rng.paretovariate(1.1)), vocab - 1) if zipf else rng.randrange(vocab)
                          for _ in range(size)]
                pool.update(i, tokens)
                pool.release(i)
            used = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
        assert 0.75 < used / pool.nbytes < 1.25, (vocab, zipf, used, pool.nbytes)


def test_the_pool_stays_within_its_budget_under_two_thousand_requests():
    rng = random.Random(1)
    budget = 400_000
    pool = SuffixPool(max_bytes=budget)
    peak = 0
    for request in range(2000):
        salt = f"tenant{request % 3}"
        tokens = [rng.randrange(500) for _ in range(rng.randint(20, 120))]
        for end in range(10, len(tokens) + 1, 10):  # a request's text grows round by round
            pool.update(request, tokens[:end], salt)
            peak = max(peak, pool.nbytes)
        pool.propose(request, 8, 8)
        pool.release(request)
    stats = pool.stats()
    assert peak <= budget and stats["bytes"] <= budget
    assert stats["evictions"] > 1000 and stats["sequences"] < 2000
    counts = dict(stats)
    _recount(pool, counts)


def _recount(pool: SuffixPool, counts: dict) -> None:
    """The incremental counts equal a recount of what the pool holds."""
    keys = sum(len(k) + len(s) for k, s in pool._index.values())
    occurrences = sum(len(a) for k, s in pool._index.values() for table in (k, s) for a in table.values())
    assert counts["keys"] == keys and counts["occurrences"] == occurrences
    assert counts["tokens"] == sum(len(h.tokens) for h in pool._held.values())


def test_eviction_takes_the_least_recently_used():
    cost = (suffix_pool.SEQUENCE_BYTES + 6 * suffix_pool.TOKEN_BYTES + 10 * suffix_pool.KEY_BYTES
            + 10 * suffix_pool.OCCURRENCE_BYTES)
    pool = SuffixPool(max_bytes=3 * cost + 400, share_unsalted=True)  # room for three and a short query
    for first in (10, 20, 30):
        pool.add([first + i for i in range(6)])
    assert pool.stats()["sequences"] == 3
    pool.update("q", [10, 11, 12])  # drafting from the first sequence makes it the most recently used
    assert pool.propose("q", 4, 4).tokens == (13, 14, 15)
    pool.release("q")
    pool.add([40 + i for i in range(6)])
    pool.update("r", [20, 21, 22])  # the second one was least recently used: gone
    assert pool.propose("r", 4, 4).tokens == ()
    pool.update("s", [10, 11, 12])
    assert pool.propose("s", 4, 4).tokens == (13, 14, 15)


def test_a_sequence_larger_than_the_budget_is_not_held():
    pool = SuffixPool(max_bytes=1000, share_unsalted=True)
    pool.update("big", list(range(500)))
    assert pool.stats()["sequences"] == 0 and pool.nbytes == 0
    assert pool.propose("big", 4, 4).tokens == ()


def test_save_and_load_round_trip(tmp_path):
    pool = SuffixPool()
    pool.update("a", [1, 2, 3, 4, 5], salt="A")
    pool.release("a")
    pool.add([1, 2, 3, 9, 9], salt="B")
    pool.update("own", [1, 2, 3, 7])  # an unsalted running sequence: its own tenant, not saved
    path = tmp_path / "pool.jsonl"
    assert pool.save(path) == 2
    assert "A" not in path.read_text().replace("salt:", "")
    loaded = SuffixPool()
    assert loaded.load(path) == 2
    for salt, tail in (("A", (4, 5)), ("B", (9, 9))):
        loaded.update(salt, [0, 1, 2, 3], salt=salt)
        assert loaded.propose(salt, 4, 4).tokens == tail
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "hi"}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:1: not a suffix-pool line"):
        loaded.load(bad)


def test_refusals_name_the_fix():
    with pytest.raises(ValueError, match="max_bytes must be a positive int"):
        SuffixPool(max_bytes=0)
    with pytest.raises(ValueError, match="salt must be a string"):
        SuffixPool().update("x", [1], salt=3)
    with pytest.raises(ValueError, match="token ids must be in"):
        SuffixPool().update("x", [-1])


def test_concurrent_updates_lookups_and_saves_keep_the_books(tmp_path):
    pool = SuffixPool(max_bytes=200_000)
    errors = []

    def work(worker):
        rng = random.Random(worker)
        try:
            for request in range(150):
                seq = (worker, request)
                tokens = [rng.randrange(50) for _ in range(60)]
                for end in range(5, 61, 5):
                    pool.update(seq, tokens[:end], salt=f"s{worker % 2}")
                    pool.propose(seq, 6, 6)
                pool.release(seq)
                if request % 50 == 0:
                    pool.save(tmp_path / f"w{worker}.jsonl")
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=work, args=(w,)) for w in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert pool.nbytes <= 200_000
    _recount(pool, pool.stats())
