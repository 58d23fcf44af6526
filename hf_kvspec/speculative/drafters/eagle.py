"""EAGLE drafting (Li et al. 2401.15077; EAGLE-2 dynamic trees 2406.16858; EAGLE-3 feature fusion 2503.01840).

Boundary: owns the ``EagleHead``'s own KV cache (a ``DynamicCache`` over its one decoder layer) and the target
features it has not fed yet; drafts a tree per round through ``tree.py``'s growers. Never touches the target's cache.

Alignment with the loop's ``TokenBuffer`` (column c of the drafter cache is buffer column c, holes included):
column c holds the pair (target feature after token c, the next real token after c) at token c's position -- the
shifted pairing the drafter was trained on. The buffer's last column (the newest token, the tree's root) has no
target feature yet, so the cache holds ``width - 1`` columns between rounds.

One round:
    catch-up   feed the columns committed since the last round with the target's own features; the output at
               each row's last real column scores the root's children.
    grow       each level feeds the expanded nodes with their parent's draft output in place of a feature,
               at position root + depth - 1, each seeing the committed columns, its ancestors and itself.
    roll back  crop the tree rows off the cache. Accepted nodes come back next round in the catch-up with the
               target's true features (EAGLE re-feeds them too), so no keep-positions step is needed here.

State: ``EagleRows`` (the cache, the columns it holds, the features not fed yet, the last root's output) for the
rows of one buffer. The serving engine keeps one one-row ``EagleRows`` per request (``open_rows``) and drafts for
all its drafting requests at once (``propose_each``): ``stack_rows`` lays the sequences out as one buffer with
holes (each sequence's cached columns right-aligned, then its new ones), the same catch-up and growth run over it,
and each sequence keeps its new cache columns; every sequence gets the tree it would grow alone.

Shapes: ``B`` rows, ``W`` buffer width, ``m`` fed rows, ``H`` hidden, ``F`` feature width, ``V`` vocabulary,
``R`` sequences drafted together.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from hf_kvspec.masking import additive_mask
from hf_kvspec.speculative.autotree import AutoTreeSize, dynamic_menu, fit_tree, static_menu
from hf_kvspec.speculative.buffer import TokenBuffer
from hf_kvspec.speculative.draft_vocab import DraftVocabulary
from hf_kvspec.speculative.drafters.base import Assistant, DraftContext, DraftProposal, RoundOutcome
from hf_kvspec.speculative.drafters.checks import require_count, require_head, require_rank_fits
from hf_kvspec.speculative.drafters.features import begin_with_features
from hf_kvspec.speculative.tree import (
    StaticTree,
    grow_dynamic_pool,
    grow_dynamic_tree,
    grow_static_tree,
    static_tree,
)


class EagleAssistant(Assistant):
    """``EagleAssistant(head, tree="dynamic", depth=5, top_k=4, total_tokens=24)``.

    ``tree="dynamic"``: EAGLE-2, per-row trees of ``total_tokens`` nodes grown ``depth`` levels deep with ``top_k``
    children per expanded node; ``"chain"``: ``depth`` tokens; a choice list: a static tree whose node
    ``(r_1, .., r_d)`` takes the drafter's rank-``r_d`` token after its parent's path. ``num_draft_tokens`` caps
    the nodes (``None`` = the tree's size; ``"auto"``, the default = node count and depth chosen each round from
    measured acceptance and verify cost, ``autotree.AutoTreeSize``, plain decoding when no tree pays). Near ``max_new_tokens`` the loop caps the depth, not
    the width. Defaults are sized for CPU verification, where every extra verified node costs (EAGLE-2's GPU
    defaults are 60 nodes, depth 7, top-k 10).
    ``draft_vocab_size``: the drafter scores only the most frequent target tokens (FR-Spec, ``draft_vocab.py``),
    ranked by ``draft_vocab`` (ids tensor or file; default: the ranking shipped in the head's directory); the tree
    is grown in draft-vocabulary columns and mapped back to target ids. Still exact (the target verifies). The
    default ``"shipped"`` takes ``draft_vocab.SHIPPED_SIZE`` ids of a shipped ranking when the head has one (the
    bundled heads do); ``None`` scores the full vocabulary.

    The drafter reads the target features of ``config.feature_layers``; the loop must pass exactly those,
    concatenated (``features.FeatureCapture``). A head that is not attached yet is attached on the first call.
    """

    wants_hidden_states = True
    proposes_trees = True  # the loop checks up front that the target's attention takes a 4D tree mask

    def __init__(self, head, tree: str | Sequence[Sequence[int]] = "dynamic", depth: int = 5,
                 top_k: int = 4, total_tokens: int = 24, num_draft_tokens: int | str | None = "auto",
                 draft_vocab_size: int | str | None = "shipped", draft_vocab=None):
        require_head("EagleAssistant", head)
        for name, value in (("depth", depth), ("top_k", top_k), ("total_tokens", total_tokens)):
            require_count(name, value)
        self.static = None if tree == "dynamic" else static_tree(tree, depth)
        size = total_tokens if self.static is None else self.static.num_nodes
        super().__init__(size if num_draft_tokens is None else num_draft_tokens, max_draft_tokens=size)
        if num_draft_tokens == "auto":
            self.auto = AutoTreeSize(dynamic_menu(depth, total_tokens, top_k) if self.static is None
                                     else static_menu(self.static))
        self.head = head.eval()
        if draft_vocab_size not in (None, "shipped") and getattr(head, "has_draft_vocab", False):
            raise ValueError("this head was trained with its own draft vocabulary (config.draft_vocab_size="
                             f"{head.config.draft_vocab_size}): its projection is already restricted; leave "
                             "draft_vocab_size unset.")
        self.vocab = DraftVocabulary.resolve(head, draft_vocab_size, draft_vocab)
        if self.static is None:
            require_rank_fits(f"top_k={top_k}", top_k, head, self.vocab, "pass a smaller top_k")
        else:
            require_rank_fits(f"the tree (a node of rank {self.static.max_rank - 1})", self.static.max_rank, head,
                              self.vocab, "use a tree of lower ranks or a larger draft_vocab_size")
        self._fitted: dict[tuple, object] = {}
        self.feature_layers = tuple(head.config.feature_layers)
        self.depth, self.top_k, self.total_tokens = depth, top_k, total_tokens
        self.rows: EagleRows | None = None  # the call's drafter state, aligned with the loop's buffer

    # ------------------------------------------------------------------------------------------ state
    def begin(self, target, buffer, target_hidden=None) -> None:
        super().begin(target, buffer, target_hidden)
        self.rows = self.open_rows(target, buffer.width, target_hidden)

    def open_rows(self, target, width: int, target_hidden: torch.Tensor | None) -> EagleRows:
        """Fresh drafter state for rows of ``width`` buffer columns whose prompt features ``target_hidden``
        ``[B, P', F]`` the target's forward returned (zeros for the ``width - 1 - P'`` columns a cache held
        already: still exact, fewer drafts accepted). Attaches the head to ``target``."""
        begin_with_features(self, self.head, target, target_hidden)
        size = len(self.feature_layers) * self.head.config.base_hidden_size
        if target_hidden.shape[-1] != size:
            raise ValueError(f"the drafter reads target layers {list(self.feature_layers)} ({size} features per "
                             f"token) but got {target_hidden.shape[-1]}; pass FeatureCapture(target, "
                             f"{list(self.feature_layers)}).features() as the target's hidden states.")
        missing = width - 1 - target_hidden.shape[1]  # prompt columns a caller's cache held already
        return EagleRows(DynamicCache(), 0, [torch.nn.functional.pad(target_hidden, (0, 0, max(missing, 0), 0))])

    def observe(self, outcome: RoundOutcome) -> None:
        super().observe(outcome)
        self.rows.observe(outcome.kept_width, outcome.target_hidden)

    def release(self, rows: list[int]) -> None:
        self.rows.select(self.staying(rows))

    def kernel_modules(self) -> tuple:
        return (self.head,)

    def end(self) -> None:
        self.rows = None

    # ------------------------------------------------------------------------------------------ drafting
    @torch.no_grad()
    def propose(self, ctx: DraftContext) -> DraftProposal:
        count = ctx.num_draft_tokens
        depth = self.auto.shape.depth if isinstance(self.auto, AutoTreeSize) else self.depth
        max_depth = ctx.max_depth or count  # the loop's cap near max_new_tokens
        root_logprobs, expand = self._root(self.rows, ctx.buffer)
        if self.static is None:
            tree = grow_dynamic_tree(root_logprobs, expand, max(1, min(depth, count, max_depth)), self.top_k,
                                     min(self.total_tokens, count))
            parents = tree.parents  # [B, N] per row
        else:
            static = self._static_tree(count, max_depth)
            tree, parents = grow_static_tree(root_logprobs, expand, static), static.parents.to(root_logprobs.device)
        self.rows.crop_tree()
        return DraftProposal(self.target_ids(tree.tokens), None, parents, draft_forwards=1 + expand.calls)

    @torch.no_grad()
    def propose_each(self, rows: list[EagleRows], tokens: list[list[int]], counts: list[int],
                     max_depths: list[int]) -> list[DraftProposal]:
        """One proposal ``[1, N_i]`` per one-row state ``rows[i]`` (a request of the serving engine, its tokens
        ``tokens[i]``, the last not yet fed to the target), of at most ``counts[i]`` nodes and ``max_depths[i]``
        levels: all rows drafted together, one head forward for the catch-up and one per tree level, as the
        same rows would be in one rectangular call (``stack_rows``; each row's tree is the one it would grow
        alone). Each state keeps its own catch-up."""
        batch, buffer, new = stack_rows(rows, tokens)
        root_logprobs, expand = self._root(batch, buffer)
        batch.unstack_catch_up(rows, new)
        deepest = max(1, min(self.depth, max(counts), max(max_depths)))
        if self.static is None:
            pool = grow_dynamic_pool(root_logprobs, expand, deepest, self.top_k)
            trees = [pool.row_tree(i, min(self.total_tokens, count), max(1, min(self.depth, count, depth)))
                     for i, (count, depth) in enumerate(zip(counts, max_depths))]
            proposals = [DraftProposal(self.target_ids(tree.tokens), None, tree.parents, 1 + expand.calls)
                         for tree in trees]
        else:  # one growth over the union of the rows' trees; a node's token does not depend on its siblings
            trees = [self._static_tree(count, depth) for count, depth in zip(counts, max_depths)]
            order = {choice: n for n, choice in enumerate(self.static.choices)}
            union = StaticTree.from_choices(sorted(set().union(*(t.choices for t in trees)), key=order.__getitem__))
            node = {choice: n for n, choice in enumerate(union.choices)}
            tokens = self.target_ids(grow_static_tree(root_logprobs, expand, union).tokens)  # [R, N_union]
            proposals = [DraftProposal(tokens[i:i + 1, [node[c] for c in tree.choices]], None,
                                       tree.parents.to(tokens.device), 1 + expand.calls)
                         for i, tree in enumerate(trees)]
        return proposals

    def _root(self, rows: EagleRows, buffer) -> tuple[torch.Tensor, _TreeRows]:
        """The catch-up over ``buffer``'s new columns -> (the root's children's log-probabilities [B, V], the
        tree's ``expand`` callback)."""
        root_hidden = self._catch_up(rows, buffer)  # [B, H]
        root_logprobs = self._logprobs(root_hidden[:, None])[:, 0]  # [B, V] (V': draft vocabulary columns)
        return root_logprobs, _TreeRows(self, rows, root_hidden, buffer)

    def _static_tree(self, count: int, max_depth: int):
        key = (count, max_depth)
        if key not in self._fitted:
            self._fitted[key] = fit_tree(self.static, count, max_depth)
        return self._fitted[key]

    def target_ids(self, tokens: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary columns -> target token ids: the ranking's (``draft_vocab_size=``), the head's own trained
        vocabulary (``d2t``, EAGLE-3), or the identity."""
        return self.head.draft_to_target(tokens) if self.vocab is None else self.vocab.to_target(tokens)

    def _catch_up(self, rows: EagleRows, buffer) -> torch.Tensor:
        """Feed buffer columns ``cached .. width - 2`` with their target features -> ``[B, H]`` the output at each
        row's last real column (kept from the last call when nothing new was committed)."""
        start, end = rows.cached, buffer.width - 1
        if end == start:
            return rows.root_hidden
        positions = buffer.positions[:, start:end]  # [B, m]
        mask = additive_mask(_catch_up_mask(buffer.mask[:, :end], start), self.head.dtype)  # [B, 1, m, end]
        out = self.head(next_real_tokens(buffer.tokens, buffer.mask)[:, start:end],
                        features=rows.pending.to(self.head.dtype), position_ids=positions, attention_mask=mask,
                        cache=rows.cache, return_logits=False)
        last = _last_real(buffer.mask[:, :end])  # [B]
        index = torch.arange(last.shape[0], device=last.device)
        hidden = out.hidden_states[index, last.clamp_min(start) - start]  # [B, H]
        if rows.root_hidden is not None:  # a row with no new real column keeps its last root's output
            hidden = torch.where((last >= start)[:, None], hidden, rows.root_hidden.to(hidden.dtype))
        rows.cached, rows.chunks, rows.root_hidden = end, [rows.pending[:, :0]], hidden
        return hidden

    def _logprobs(self, draft_hidden: torch.Tensor) -> torch.Tensor:
        # [B, m, H] -> [B, m, V] float32 log-probabilities of the next token ([B, m, V'] over the draft vocabulary)
        if self.vocab is None:
            logits = self.head.logits(draft_hidden)
        else:
            logits = self.vocab.logits(self.head.norm(draft_hidden), self.head.borrowed().lm_head.weight)
        return torch.log_softmax(logits.float(), dim=-1)


@dataclass
class EagleRows:
    """The drafter's state for ``B`` rows aligned with a token buffer: column c of ``cache`` (the head's one layer)
    is buffer column c; ``pending`` ``[B, m, F]`` are the target features of columns ``cached .. cached + m - 1``,
    not fed yet (kept in ``chunks`` as the rounds delivered them, so a round that drafts nothing copies nothing);
    ``root_hidden`` ``[B, H]`` is the output that scored the last root's children."""

    cache: DynamicCache
    cached: int
    chunks: list[torch.Tensor]  # [B, m_j, F] each, in column order; at least one (possibly empty)
    root_hidden: torch.Tensor | None = None

    @property
    def pending(self) -> torch.Tensor:
        """``[B, m, F]`` the features not fed yet, in one tensor."""
        if len(self.chunks) > 1:
            self.chunks = [torch.cat(self.chunks, dim=1)]
        return self.chunks[0]

    @property
    def pending_width(self) -> int:
        return sum(chunk.shape[1] for chunk in self.chunks)

    def observe(self, kept_width: int, target_hidden: torch.Tensor) -> None:
        """The target now holds ``kept_width`` columns; ``target_hidden`` ``[B, >= new, F]`` starts with the features
        of the columns committed since the last round (the root's, then the accepted path's)."""
        new = kept_width - self.cached - self.pending_width
        self.chunks.append(target_hidden[:, :new].to(self.chunks[0].dtype))

    def select(self, index: torch.Tensor) -> None:
        """Keep rows ``index`` [A] (a CPU tensor)."""
        if self.cache.get_seq_length() > 0:
            self.cache.batch_select_indices(index)
        device_index = index.to(self.chunks[0].device)
        self.chunks = [self.pending[device_index]]
        if self.root_hidden is not None:
            self.root_hidden = self.root_hidden[device_index]

    def crop_tree(self) -> None:
        """Roll the tree rows of a proposal off the cache (accepted nodes come back in the next catch-up)."""
        tree_rows = self.cache.get_seq_length() - self.cached
        if tree_rows:
            self.cache.crop(-tree_rows)

    def unstack_catch_up(self, rows: list[EagleRows], new: list[int]) -> None:
        """A stacked state (``stack_rows``) after its catch-up: each one-row state ``rows[i]`` takes its ``new[i]``
        newest cache columns and its root output (a row with nothing new keeps its own)."""
        keys, values = self.cache.layers[0].keys, self.cache.layers[0].values  # [R, Hkv, cached, D]
        for i, (row, count) in enumerate(zip(rows, new)):
            if count == 0:
                continue
            row.cache.update(keys[i:i + 1, :, self.cached - count:], values[i:i + 1, :, self.cached - count:], 0)
            row.cached, row.chunks = row.cached + count, [row.pending[:, :0]]
            row.root_hidden = self.root_hidden[i:i + 1]


def stack_rows(rows: list[EagleRows], tokens: list[list[int]]) -> tuple[EagleRows, TokenBuffer, list[int]]:
    """One-row states of sequences of different lengths as one state of ``R`` rows over a buffer with holes: row i
    holds its ``c_i`` cached columns right-aligned at ``S = max c``, then its ``m_i`` pending columns
    right-aligned at ``S + P`` (``P = max m``), then its newest token (the root) in the last column::

        columns   0 ..  S-1  |  S .. S+P-1   |  S+P
        row i     holes, c_i |  holes, m_i   |  root

    Holes are masked out and skipped by positions, as the loop's holes are (``buffer.py``), so each row attends to
    and is positioned by its own columns only. Returns (the state, the buffer, ``[m_i]``)."""
    cached = max(row.cached for row in rows)
    new = [len(seq) - 1 - row.cached for row, seq in zip(rows, tokens)]
    pending_width = max(new)
    if any(count != row.pending_width for count, row in zip(new, rows)):
        raise ValueError("each EAGLE row state must hold the features of its sequence's uncached columns.")
    width = cached + pending_width + 1
    ids = torch.zeros(len(rows), width, dtype=torch.long)  # holes hold token 0, masked
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    first = rows[0].pending
    pending = first.new_zeros(len(rows), pending_width, first.shape[-1])
    for i, (row, seq) in enumerate(zip(rows, tokens)):
        seq = torch.tensor(seq, dtype=torch.long)
        c, m = row.cached, new[i]
        for start, part in ((cached - c, seq[:c]), (cached + pending_width - m, seq[c:c + m]), (width - 1, seq[-1:])):
            ids[i, start:start + part.shape[0]], mask[i, start:start + part.shape[0]] = part, 1
        pending[i, pending_width - m:] = row.pending[0]
    batch = EagleRows(DynamicCache(), cached, [pending], _stacked_roots(rows))
    if cached:
        batch.cache.update(*_left_padded(rows, cached), 0)
    device = first.device
    return batch, TokenBuffer(ids.to(device), mask.to(device), 0), new


def _left_padded(rows: list[EagleRows], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's cached keys and values ``[1, Hkv, c_i, D]`` right-aligned in ``[R, Hkv, width, D]`` (zeros before:
    the holes)."""
    sample = next(row.cache.layers[0] for row in rows if row.cached)
    shape = (len(rows), sample.keys.shape[1], width, sample.keys.shape[3])
    keys, values = sample.keys.new_zeros(shape), sample.values.new_zeros(shape)
    for i, row in enumerate(rows):
        if row.cached:
            keys[i, :, width - row.cached:] = row.cache.layers[0].keys[0]
            values[i, :, width - row.cached:] = row.cache.layers[0].values[0]
    return keys, values


def _stacked_roots(rows: list[EagleRows]) -> torch.Tensor | None:
    """``[R, H]`` every row's last root output (zeros where a row has none: it has new columns to catch up)."""
    known = [row.root_hidden for row in rows if row.root_hidden is not None]
    if not known:
        return None
    return torch.cat([row.root_hidden if row.root_hidden is not None else known[0].new_zeros(known[0].shape)
                      for row in rows])


class _TreeRows:
    """The ``expand`` callback of ``tree.py``: feeds one level of nodes into the drafter cache (after the committed
    columns), each seeing its ancestors among the earlier tree rows; remembers outputs and visibility."""

    def __init__(self, assistant: EagleAssistant, rows: EagleRows, root_hidden: torch.Tensor, buffer):
        self.assistant, self.cache = assistant, rows.cache
        self.prefix = buffer.mask[:, : rows.cached].bool()  # [B, S] real committed columns
        self.root_position = buffer.positions[:, -1:]  # [B, 1]
        self.hidden = root_hidden[:, None]  # [B, 1, H] outputs of the previous call's rows (first: the root's)
        self.visible = root_hidden.new_zeros(root_hidden.shape[0], 1, 0, dtype=torch.bool)  # [B, m, F] tree rows
        self.calls = 0

    def __call__(self, tokens: torch.Tensor, parent_slot: torch.Tensor) -> torch.Tensor:
        # tokens, parent_slot [B, m] -> log-probs [B, m, V] of each fed node's children
        batch, count = tokens.shape
        slot = parent_slot.clamp_min(0)[..., None]  # [B, m, 1]; level-1 nodes read the root's slot 0
        parent_hidden = self.hidden.gather(1, slot.expand(-1, -1, self.hidden.shape[-1]))  # [B, m, H]
        inherited = self.visible.gather(1, slot.expand(-1, -1, self.visible.shape[-1]))  # [B, m, F]
        own = torch.eye(count, dtype=torch.bool, device=tokens.device).expand(batch, count, count)
        self.visible = torch.cat([inherited, own], dim=2)  # [B, m, F + m]
        allowed = torch.cat([self.prefix[:, None].expand(-1, count, -1), self.visible], dim=2)[:, None]
        head = self.assistant.head
        positions = (self.root_position + self.calls).expand(batch, count)  # depth d sits at root + d - 1
        out = head(self.assistant.target_ids(tokens), draft_hidden=parent_hidden, position_ids=positions,
                   attention_mask=additive_mask(allowed, head.dtype), cache=self.cache, return_logits=False)
        self.hidden = out.hidden_states
        self.calls += 1
        return self.assistant._logprobs(self.hidden)


def next_real_tokens(tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B, W]`` -> ``[B, W]`` the token of the first real column after each column (the last column's own token
    where none follows): the token EAGLE pairs with column c's feature, skipping holes."""
    width = tokens.shape[1]
    cols = torch.arange(width, device=tokens.device).expand_as(tokens)
    real = torch.where(mask.bool(), cols, width)
    after = torch.cat([real[:, 1:], real.new_full((real.shape[0], 1), width)], dim=1)
    following = after.flip(1).cummin(dim=1).values.flip(1).clamp_max(width - 1)
    return tokens.gather(1, following)


def _last_real(mask: torch.Tensor) -> torch.Tensor:
    # [B, W] -> [B] index of the last real column (0 when none)
    cols = torch.arange(mask.shape[1], device=mask.device)
    return torch.where(mask.bool(), cols, 0).max(dim=1).values


def _catch_up_mask(mask: torch.Tensor, start: int) -> torch.Tensor:
    """Bool ``[B, 1, W - start, W]`` (True = attend): query column q sees real columns up to q, and itself (a hole
    query then attends somewhere, so no row is fully masked)."""
    width = mask.shape[1]
    queries = torch.arange(start, width, device=mask.device)[:, None]
    keys = torch.arange(width, device=mask.device)[None, :]
    allowed = (mask.bool()[:, None, :] & (keys <= queries)) | (keys == queries)  # [B, m, W]
    return allowed[:, None]
