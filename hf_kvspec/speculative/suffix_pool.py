"""Drafting from text seen before: a pool of token sequences (earlier prompts and outputs, and the running requests'
own tokens) indexed so that what followed a context's suffix, anywhere in the pool, can be counted.

Boundary: integer bookkeeping over token ids (plain Python arrays and dicts, no tensors, no model). Who adds which
sequence under which salt is the caller's (``drafters/suffix.py`` in ``generate``, ``serving/suffix_drafting.py``
in the engine); verification is the round's, so nothing here can change an output, only how often drafts hit.

Terms (after SuffixDecoding, arXiv 2411.04975, which drafts from suffix trees over earlier prompts and outputs):
    sequence      one request's prompt + output so far (or a finished one kept as history), named by the caller's
                  ``seq_id`` while it runs.
    tenant        who may read a sequence: every sequence added under salt s is read only by lookups under salt s.
                  Unsalted sequences form one shared tenant only when the pool is built with ``share_unsalted=True``;
                  otherwise each unsalted sequence is a tenant of its own (it drafts from its own text only) and is
                  dropped when released. A shared pool without tenants proposes one user's text as another's drafts,
                  a timing side channel (acceptance speeds up exactly when a continuation matches someone else's).
    key           the ``KEY_LENGTH`` tokens ending at a position (and, as a fallback, the single token there);
                  each key maps to its ``MAX_OCCURRENCES`` newest occurrences (sequence, position after the key).
    match         for an occurrence of the context's key, how many tokens before it equal the context's own,
                  up to ``MAX_MATCH``: a suffix tree's matched depth.
    draft tree    the continuations (up to ``max_depth`` tokens) of the occurrences with the longest match, merged by
                  prefix; a node's ``prob`` is the share of those occurrences that continue through it (its
                  estimated chance of being accepted). Nodes are taken best-first while ``prob >= min_prob``, at
                  most ``max_nodes``, and no deeper than ``spec_factor * match`` (vLLM's suffix method has the same
                  knobs: a short match earns a short draft).

Deviation from the paper: instead of a suffix tree over every position we keep a k-gram index and extend matches
backwards over the stored sequences, over the newest ``SCAN`` occurrences of the key: the same drafts as a suffix
tree's longest-match counts restricted to recent text, at a bounded cost per lookup (``SCAN * (MAX_MATCH +
max_depth)`` token comparisons, whatever the pool's size) and an index that is cheap to update and to evict from.

Memory: ``nbytes`` is accounted, not sampled: ``SEQUENCE_BYTES`` per sequence, ``TOKEN_BYTES`` per token,
``KEY_BYTES`` per distinct key and ``OCCURRENCE_BYTES`` per occurrence (constants checked against ``tracemalloc``
in the tests). Past ``max_bytes`` the least recently used sequences (by update or by being drafted from) are
evicted; a sequence larger than the whole budget is not held. All methods are thread-safe (one lock): the server's
event loop may save or read statistics while the engine's thread drafts.
"""

from __future__ import annotations

import hashlib
import heapq
import json
import threading
from array import array
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path

KEY_LENGTH = 3
MAX_OCCURRENCES = 64  # newest occurrences kept per key (older ones are forgotten, not evicted sequences)
SCAN = 32  # occurrences of the context's key examined per lookup, newest first
MAX_MATCH = 16  # longest match counted: longer ones tie
_TOKEN_BITS = 21  # a key packs KEY_LENGTH token ids into one int: ids must be below 2 ** 21
SEQUENCE_BYTES = 260  # the sequence's object, its array header and its LRU and id entries
TOKEN_BYTES = 4  # array('i')
KEY_BYTES = 180  # a dict slot, the packed key int and the occurrence array's header
OCCURRENCE_BYTES = 8  # array('q'): (slot << 32) | position
DEFAULT_MAX_BYTES = 64 << 20


@dataclass(frozen=True)
class SuffixDraft:
    """A proposal from the pool: ``tokens[n]`` with parent node ``parents[n]`` (-1: a child of the context's last
    token), parents listed before children, and ``probs[n]`` the node's estimated acceptance; ``match`` is the
    matched suffix length (0: nothing matched)."""

    tokens: tuple[int, ...] = ()
    parents: tuple[int, ...] = ()
    probs: tuple[float, ...] = ()
    match: int = 0

    @property
    def expected(self) -> float:
        """Expected accepted drafts under the pool's estimates (a node is accepted with its path's share)."""
        return sum(self.probs)

    @property
    def is_chain(self) -> bool:
        return all(parent == node - 1 for node, parent in enumerate(self.parents))

    def chain(self) -> SuffixDraft:
        """The most frequent path: from the root, each node's first (most frequent) child, in best-first order."""
        nodes, at = [], -1
        for node, parent in enumerate(self.parents):
            if parent == at:
                nodes.append(node)
                at = node
        return SuffixDraft(tuple(self.tokens[n] for n in nodes), tuple(range(-1, len(nodes) - 1)),
                           tuple(self.probs[n] for n in nodes), self.match)

    def cut(self, count: int) -> SuffixDraft:
        """The first ``count`` nodes (a prefix of a best-first node list is a tree)."""
        return SuffixDraft(self.tokens[:count], self.parents[:count], self.probs[:count], self.match)


class _Held:
    __slots__ = ("seq_id", "tenant", "tokens")

    def __init__(self, tenant: Hashable, seq_id: Hashable | None):
        self.tokens = array("i")
        self.tenant, self.seq_id = tenant, seq_id


def tenant_of(salt: str | None, seq_id: Hashable | None, share_unsalted: bool) -> Hashable:
    """The tenant a sequence belongs to: a digest of its salt (the salt itself is never stored), the shared unsalted
    tenant, or a tenant of its own."""
    if salt is not None:
        if not isinstance(salt, str):
            raise ValueError(f"salt must be a string (a tenant's name or secret) or None, got {salt!r}.")
        return "salt:" + hashlib.sha256(salt.encode()).hexdigest()[:32]
    return "unsalted" if share_unsalted else ("own", seq_id)


class SuffixPool:
    """Token sequences by tenant, indexed for drafting (module docstring).

    Args:
        max_bytes: the accounted memory the pool may hold (least recently used sequences are evicted past it).
        share_unsalted: unsalted sequences share one tenant (opt-in: only for a single-user deployment); by default
            each unsalted sequence drafts from its own text only and is dropped when released.
    """

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES, share_unsalted: bool = False):
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
            raise ValueError(f"max_bytes must be a positive int, got {max_bytes!r}.")
        self.max_bytes, self.share_unsalted = max_bytes, bool(share_unsalted)
        self._lock = threading.RLock()
        self._held: OrderedDict[int, _Held] = OrderedDict()  # slot -> sequence, least recently used first
        self._slots: dict[Hashable, int] = {}  # a running sequence's id -> its slot
        self._index: dict[Hashable, tuple[dict[int, array], dict[int, array]]] = {}  # tenant -> (keys, tokens)
        self._next_slot = 0
        self._counts = dict(sequences=0, tokens=0, keys=0, occurrences=0)
        self.lookups = self.hits = self.evictions = 0

    # ---- adding and releasing ----------------------------------------------------------------------------
    def update(self, seq_id: Hashable, tokens: Sequence[int], salt: str | None = None) -> None:
        """Running sequence ``seq_id`` now holds ``tokens`` (its whole text so far, which only grows): the pool
        indexes what it has not seen. The salt is read when the sequence is first seen."""
        with self._lock:
            slot = self._slots.get(seq_id)
            if slot is None:
                slot = self._new(tenant_of(salt, seq_id, self.share_unsalted), seq_id)
                if slot is None:
                    return
                self._slots[seq_id] = slot
            held = self._held[slot]
            self._held.move_to_end(slot)
            if len(tokens) > len(held.tokens):
                self._append(slot, held, tokens[len(held.tokens):])
            self._evict(keep=slot)

    def add(self, tokens: Sequence[int], salt: str | None = None) -> None:
        """A finished sequence (a past request's prompt and output) kept as history under ``salt``'s tenant. An
        unsalted one is kept only in a pool that shares unsalted text."""
        with self._lock:
            if salt is None and not self.share_unsalted:
                return
            self._add_finished(tenant_of(salt, None, self.share_unsalted), tokens)

    def release(self, seq_id: Hashable) -> None:
        """Sequence ``seq_id`` ended: it stays as history of its tenant, or goes with its own tenant."""
        with self._lock:
            slot = self._slots.pop(seq_id, None)
            if slot is None:
                return
            if isinstance(self._held[slot].tenant, tuple):  # a tenant of its own: no one may read it any more
                self._remove(slot)
            else:
                self._held[slot].seq_id = None

    # ---- drafting ------------------------------------------------------------------------------------------
    def propose(self, seq_id: Hashable, max_nodes: int, max_depth: int, min_prob: float = 0.1,
                spec_factor: float = 1.0) -> SuffixDraft:
        """A draft tree after running sequence ``seq_id``'s text, from its tenant's sequences (module docstring)."""
        with self._lock:
            slot = self._slots.get(seq_id)
            self.lookups += 1
            if slot is None or max_nodes <= 0 or max_depth <= 0:
                return SuffixDraft()
            held = self._held[slot]
            match, continuations = self._continuations(slot, held, max_depth)
            depth = min(max_depth, int(spec_factor * match))
            draft = _best_first(continuations, depth, max_nodes, min_prob, match)
            self.hits += bool(draft.tokens)
            return draft

    def _continuations(self, slot: int, held: _Held, max_depth: int) -> tuple[int, list]:
        """(longest match, the continuations of the occurrences that match that far)."""
        tokens, keys, singles = held.tokens, *self._index[held.tenant]
        length = len(tokens)
        found = keys.get(_pack(tokens[-KEY_LENGTH:])) if length >= KEY_LENGTH else None
        if not found or (len(found) == 1 and found[-1] == (slot << 32 | length)):
            found = singles.get(tokens[-1]) if length else None
        best, continuations = 0, []
        for code in reversed((found or array("q"))[-SCAN - 1:]):  # the newest SCAN (and the own tail, skipped)
            other_slot, position = code >> 32, code & 0xFFFFFFFF
            other = self._held[other_slot].tokens
            follow = other[position: position + max_depth]
            if not follow:  # the context's own tail
                continue
            match = _match(other, position, tokens)
            if match > best:
                best, continuations = match, [(other_slot, follow)]
            elif match == best:
                continuations.append((other_slot, follow))
        for other_slot, _ in continuations:
            if other_slot in self._held:
                self._held.move_to_end(other_slot)
        return best, [follow for _, follow in continuations]

    # ---- size, statistics, persistence ----------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        """Accounted bytes held (module docstring)."""
        counts = self._counts
        return (counts["sequences"] * SEQUENCE_BYTES + counts["tokens"] * TOKEN_BYTES + counts["keys"] * KEY_BYTES
                + counts["occurrences"] * OCCURRENCE_BYTES)

    def stats(self) -> dict:
        """Sizes and use: sequences, tokens, bytes (of ``max_bytes``), tenants, lookups, hits and hit rate."""
        with self._lock:
            return dict(self._counts, bytes=self.nbytes, max_bytes=self.max_bytes, tenants=len(self._index),
                        lookups=self.lookups, hits=self.hits, hit_rate=self.hits / max(self.lookups, 1),
                        evictions=self.evictions)

    def save(self, path: str | Path) -> int:
        """Write the shared tenants' sequences (not the per-request ones) to ``path`` as JSON lines
        ``{"tenant": ..., "tokens": [...]}``, oldest first; returns how many. Tenants are salt digests, never
        salts; the file holds your users' text, so keep it as private as your request logs."""
        with self._lock:
            lines = [json.dumps({"tenant": held.tenant, "tokens": held.tokens.tolist()})
                     for held in self._held.values() if not isinstance(held.tenant, tuple)]
        Path(path).write_text("".join(line + "\n" for line in lines))
        return len(lines)

    def load(self, path: str | Path) -> int:
        """Add the sequences ``save`` wrote (as finished history, each under its tenant); returns how many."""
        count = 0
        with Path(path).open() as lines, self._lock:
            for number, line in enumerate(lines, 1):
                if not line.strip():
                    continue
                record = json.loads(line)
                tenant = record.get("tenant")
                if not isinstance(tenant, str) or not isinstance(record.get("tokens"), list):
                    raise ValueError(f"{path}:{number}: not a suffix-pool line (SuffixPool.save writes "
                                     "{'tenant': str, 'tokens': [int, ...]}).")
                if tenant == "unsalted" and not self.share_unsalted:
                    continue  # a pool that keeps unsalted text apart takes none
                self._add_finished(tenant, record["tokens"])
                count += 1
        return count

    # ---- bookkeeping -----------------------------------------------------------------------------------
    def _new(self, tenant: Hashable, seq_id: Hashable | None) -> int | None:
        slot, self._next_slot = self._next_slot, self._next_slot + 1
        if self.max_bytes < SEQUENCE_BYTES:
            return None
        self._held[slot] = _Held(tenant, seq_id)
        self._index.setdefault(tenant, ({}, {}))
        self._counts["sequences"] += 1
        return slot

    def _add_finished(self, tenant: Hashable, tokens: Sequence[int]) -> None:
        slot = self._new(tenant, None)
        if slot is not None:
            self._append(slot, self._held[slot], tokens)
            self._evict(keep=None)

    def _append(self, slot: int, held: _Held, new: Sequence[int]) -> None:
        """Append ``new`` tokens to ``held`` and index the positions they end."""
        if any(not 0 <= int(t) < 1 << _TOKEN_BITS for t in new):
            raise ValueError(f"token ids must be in [0, {1 << _TOKEN_BITS}) for the suffix pool.")
        keys, singles = self._index[held.tenant]
        tokens = held.tokens
        for token in new:
            tokens.append(int(token))
            end = len(tokens)
            self._occur(singles, tokens[-1], slot << 32 | end)
            if end >= KEY_LENGTH:
                self._occur(keys, _pack(tokens[-KEY_LENGTH:]), slot << 32 | end)
        self._counts["tokens"] += len(new)

    def _occur(self, table: dict[int, array], key: int, code: int) -> None:
        found = table.get(key)
        if found is None:
            table[key] = found = array("q")
            self._counts["keys"] += 1
        found.append(code)
        if len(found) > MAX_OCCURRENCES:
            del found[0]
        else:
            self._counts["occurrences"] += 1

    def _evict(self, keep: int | None) -> None:
        """Evict least recently used sequences (never ``keep``) until the pool fits its budget."""
        while self.nbytes > self.max_bytes:
            victim = next((slot for slot in self._held if slot != keep), None)
            if victim is None:  # only ``keep`` is left and it alone is too large: not held
                victim = keep
            held = self._held[victim]
            if held.seq_id is not None:
                self._slots.pop(held.seq_id, None)
            self._remove(victim)
            self.evictions += 1
            if victim == keep:
                return

    def _remove(self, slot: int) -> None:
        """Forget sequence ``slot`` and every occurrence of it in its tenant's index."""
        held = self._held.pop(slot)
        keys, singles = self._index[held.tenant]
        tokens = held.tokens
        for table, table_keys in ((singles, set(tokens)),
                                  (keys, {_pack(tokens[i - KEY_LENGTH: i]) for i in range(KEY_LENGTH, len(tokens) + 1)})):
            for key in table_keys:
                self._drop_occurrences(table, key, slot)
        self._counts["sequences"] -= 1
        self._counts["tokens"] -= len(tokens)
        if isinstance(held.tenant, tuple):  # a tenant of its own holds one sequence
            del self._index[held.tenant]

    def _drop_occurrences(self, table: dict[int, array], key: int, slot: int) -> None:
        found = table.get(key)
        if found is None:
            return
        kept = array("q", (code for code in found if code >> 32 != slot))
        self._counts["occurrences"] -= len(found) - len(kept)
        if kept:
            table[key] = kept
        else:
            del table[key]
            self._counts["keys"] -= 1


def _pack(tokens: Sequence[int]) -> int:
    key = 0
    for token in tokens:
        key = key << _TOKEN_BITS | token
    return key


def _match(other: array, position: int, tokens: array) -> int:
    """Tokens before ``other[position]`` equal to the tokens ending ``tokens``, up to ``MAX_MATCH``."""
    match, limit = 0, min(position, len(tokens), MAX_MATCH)
    while match < limit and other[position - 1 - match] == tokens[-1 - match]:
        match += 1
    return match


def _best_first(continuations: list, depth: int, max_nodes: int, min_prob: float, match: int) -> SuffixDraft:
    """Merge ``continuations`` (token arrays) by prefix up to ``depth`` tokens and take nodes best-first by their
    share of the continuations while it is at least ``min_prob``, at most ``max_nodes``."""
    if not continuations or depth <= 0:
        return SuffixDraft(match=match)
    counts: dict[tuple[int, ...], int] = {}
    for follow in continuations:
        for end in range(1, min(depth, len(follow)) + 1):
            prefix = tuple(follow[:end])
            counts[prefix] = counts.get(prefix, 0) + 1
    total = len(continuations)
    children: dict[tuple[int, ...], list[tuple[int, ...]]] = {}
    for prefix in counts:
        children.setdefault(prefix[:-1], []).append(prefix)
    heap = [(-counts[child], child, -1) for child in children.get((), ())]
    heapq.heapify(heap)
    tokens, parents, probs, node_of = [], [], [], {}
    while heap and len(tokens) < max_nodes:
        negative, prefix, parent = heapq.heappop(heap)
        prob = -negative / total
        if prob < min_prob:
            break
        node_of[prefix] = len(tokens)
        tokens.append(prefix[-1])
        parents.append(parent)
        probs.append(prob)
        for child in children.get(prefix, ()):
            heapq.heappush(heap, (-counts[child], child, node_of[prefix]))
    return SuffixDraft(tuple(tokens), tuple(parents), tuple(probs), match)
