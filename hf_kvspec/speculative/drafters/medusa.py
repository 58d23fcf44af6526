"""Medusa drafting (Cai et al. 2401.10774): a static tree of the heads' top-k tokens from the target's own hidden state.

Boundary: owns one feature per row (the target's last hidden state that produced the row's newest token) and
turns it into a ``DraftProposal`` through ``MedusaHeads`` and a ``StaticTree``. No extra target forward: the feature
comes from the verify forward the loop runs anyway (``RoundOutcome.target_hidden``; the prompt's from ``begin``).
Verification is the loop's, with ``verify.py`` (exact); ``typical_verify`` below is the paper's lossy alternative,
used only when asked for by name (``acceptance="typical"``).

Tree layout: node ``(r_1, ..., r_d)`` of a choice list is head ``d - 1``'s rank-``r_d`` token; head k at the
feature of token t predicts token t + k + 2, i.e. depth k + 1 below the newest token (the tree's root).

Shapes: ``B`` rows, ``H`` hidden size, ``V`` vocabulary, ``N`` tree nodes, ``D`` tree depth, ``R`` top-k width.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hf_kvspec.speculative.autotree import AutoTreeSize, fit_tree, static_menu
from hf_kvspec.speculative.draft_vocab import DraftVocabulary
from hf_kvspec.speculative.drafters.base import Assistant, DraftContext, DraftProposal, RoundOutcome
from hf_kvspec.speculative.drafters.checks import require_head, require_rank_fits
from hf_kvspec.speculative.drafters.features import begin_with_features
from hf_kvspec.speculative.tree import CandidateTree, StaticTree, static_tree
from hf_kvspec.speculative.verify import VerifyResult, deepest_path, sample_tokens

ACCEPTANCE_RULES = ("exact", "typical")


class MedusaAssistant(Assistant):
    """``MedusaAssistant(heads, tree="small", acceptance="exact")``: Medusa-1 heads drafting a static tree.

    ``tree``: ``"small"`` (8 nodes, the default: on a CPU every verified node costs), ``"default"`` (26), ``"chain"`` (one node per head) or a choice list
    (``[(0,), (1,), (0, 0), ...]``, see ``hf_kvspec.speculative.tree``). ``num_draft_tokens`` caps the nodes
    (the tree's first nodes, which form a tree); ``None`` = the whole tree; ``"auto"`` = a truncation chosen each
    round from measured acceptance and verify cost (``autotree.AutoTreeSize``). Near ``max_new_tokens`` the loop
    caps the depth, not the width.
    ``draft_vocab_size``: score only the most frequent target tokens (FR-Spec, ``draft_vocab.py``), ranked by
    ``draft_vocab`` (ids tensor or file; default: the ranking shipped in the heads' directory). Still exact. The
    default ``"shipped"`` takes ``draft_vocab.SHIPPED_SIZE`` ids of a shipped ranking when the heads have one (the
    bundled heads do); ``None`` scores the full vocabulary.
    ``acceptance="typical"`` asks the loop for Medusa's typical acceptance under sampling: faster, **lossy**
    (the output no longer follows the target's distribution), flagged by ``lossy``. Heads that are not attached
    yet are attached to the target on the first call (pairing checked).
    """

    wants_hidden_states = True
    proposes_trees = True  # the loop checks up front that the target's attention takes a 4D tree mask
    feature_layers = (-1,)  # the target's final (normalised) hidden state

    def __init__(self, heads, tree: str | Sequence[Sequence[int]] = "small", acceptance: str = "exact",
                 num_draft_tokens: int | str | None = "auto", posterior_threshold: float = 0.09,
                 posterior_alpha: float = 0.3, draft_vocab_size: int | str | None = "shipped",
                 draft_vocab=None):
        require_head("MedusaAssistant", heads)
        self.tree = static_tree(tree, heads.config.num_heads)
        if self.tree.max_depth > heads.config.num_heads:
            raise ValueError(f"the tree is {self.tree.max_depth} deep but the Medusa heads have "
                             f"{heads.config.num_heads} heads; use a choice list no deeper than the heads.")
        if acceptance not in ACCEPTANCE_RULES:
            raise ValueError(f"acceptance must be one of {ACCEPTANCE_RULES}, got {acceptance!r}.")
        super().__init__(self.tree.num_nodes if num_draft_tokens is None else num_draft_tokens,
                         max_draft_tokens=self.tree.num_nodes)
        if num_draft_tokens == "auto":
            self.auto = AutoTreeSize(static_menu(self.tree))
        self.heads = heads.eval()
        self.vocab = DraftVocabulary.resolve(heads, draft_vocab_size, draft_vocab)
        require_rank_fits(f"the tree (a node of rank {self.tree.max_rank - 1})", self.tree.max_rank, heads, self.vocab,
                          "use a tree of lower ranks or a larger draft_vocab_size")
        self.acceptance = acceptance
        self.lossy = acceptance == "typical"
        #: the name the loop records in ``AcceptanceStats.lossy_rules`` when it applies ``verify`` (None: exact)
        self.lossy_rule = "medusa typical acceptance (2401.10774)" if self.lossy else None
        self.posterior_threshold, self.posterior_alpha = posterior_threshold, posterior_alpha
        self.feature = None  # [B, H] target hidden state that produced each row's newest token
        self._fitted: dict[tuple, StaticTree] = {}

    def begin(self, target, buffer, target_hidden=None) -> None:
        super().begin(target, buffer, target_hidden)
        begin_with_features(self, self.heads, target, target_hidden)
        self.feature = target_hidden[:, -1]

    def kernel_modules(self) -> tuple:
        return (self.heads,)

    @torch.no_grad()
    def ranked(self, feature: torch.Tensor, depth: int, width: int) -> torch.Tensor:
        """``feature`` [B, H] -> ``[B, depth, width]`` top-``width`` token ids of heads ``0..depth-1``, best first.
        Only the heads the tree uses are run (the reference is ``heads(feature).logits.topk(width)``)."""
        hidden = feature.to(self.heads.dtype)[:, None]  # [B, 1, H]
        ranked = []
        for k in range(depth):
            head_hidden, weight = self.heads.heads[k](hidden), self.heads.projection_weight(k)
            if self.vocab is None:
                logits = torch.einsum("bth,vh->btv", head_hidden, weight)  # [B, 1, V]
                ranked.append(logits[:, 0].topk(width, dim=-1).indices)  # [B, R]
            else:  # [B, 1, V'] over the draft vocabulary, mapped back to target ids
                ranked.append(self.vocab.to_target(self.vocab.logits(head_hidden, weight)[:, 0].topk(width).indices))
        return torch.stack(ranked, dim=1)

    def _round_tree(self, count: int, max_depth: int | None) -> StaticTree:
        """A round's tree: the first ``count`` nodes (the auto size's, or ``num_draft_tokens``), at most
        ``max_depth`` deep (the loop's depth cap near ``max_new_tokens``), cached per (size, depth)."""
        key = (count, max_depth)
        if key not in self._fitted:
            self._fitted[key] = fit_tree(self.tree, *key)
        return self._fitted[key]

    def propose(self, ctx: DraftContext) -> DraftProposal:
        tree = self._round_tree(ctx.num_draft_tokens, ctx.max_depth)
        candidates = tree.candidates(self.ranked(self.feature, tree.max_depth, tree.max_rank))
        return DraftProposal(candidates.tokens, None, tree.parents.to(candidates.tokens.device), draft_forwards=1)

    @torch.no_grad()
    def propose_each(self, features: torch.Tensor, counts: list[int], max_depths: list[int]) -> list[DraftProposal]:
        """One proposal ``[1, N_i]`` per feature row (``features`` ``[R, H]``: each the target's hidden state that
        produced a sequence's newest token), of at most ``counts[i]`` nodes and ``max_depths[i]`` levels: the
        heads run once for all rows (the deepest and widest tree's ranks), each row takes its own tree's."""
        trees = [self._round_tree(count, depth) for count, depth in zip(counts, max_depths)]
        ranked = self.ranked(features, max(t.max_depth for t in trees), max(t.max_rank for t in trees))
        proposals = []
        for i, tree in enumerate(trees):
            tokens = tree.candidates(ranked[i:i + 1]).tokens  # [1, N]: ranks past the tree's are not read
            proposals.append(DraftProposal(tokens, None, tree.parents.to(tokens.device), draft_forwards=1))
        return proposals

    def observe(self, outcome: RoundOutcome) -> None:
        super().observe(outcome)
        hidden = outcome.target_hidden  # [B, 1 + K, H], column j = the j-th kept column (root first)
        rows = torch.arange(hidden.shape[0], device=hidden.device)
        # rows that had finished (still in the batch when rows cannot leave it) carry stale counts: any column will do
        accepted = torch.where(outcome.alive, outcome.num_accepted, 0).clamp_max(hidden.shape[1] - 1)
        self.feature = hidden[rows, accepted.to(hidden.device)]

    def release(self, rows: list[int]) -> None:
        index = self.staying(rows)
        if self.feature is not None:
            self.feature = self.feature[index.to(self.feature.device)]

    def verify(self, draft_tokens: torch.Tensor, target_probs: torch.Tensor, parents: torch.Tensor | None,
               generator: torch.Generator | None = None) -> VerifyResult:
        """Typical acceptance with this assistant's thresholds (for the loop when ``acceptance == "typical"``)."""
        return typical_verify(draft_tokens, target_probs, parents, self.posterior_threshold, self.posterior_alpha,
                              generator)

    def end(self) -> None:
        self.feature = None


def typical_verify(
    draft_tokens: torch.Tensor,  # [B, N]
    target_probs: torch.Tensor,  # [B, N + 1, V] processed target distributions (row n + 1 = after node n)
    parents: torch.Tensor | None = None,  # [N] or [B, N]; None = chain
    posterior_threshold: float = 0.09,
    posterior_alpha: float = 0.3,
    generator: torch.Generator | None = None,
) -> VerifyResult:
    """Medusa's typical acceptance (Cai et al. 2401.10774, Sec. 2.3.1) -- LOSSY, not speculative sampling.

    A node is kept when its path is kept and ``target_probs(token) > min(threshold, alpha * exp(-entropy))`` of
    the distribution after its parent; the deepest kept path wins and the next token is sampled from the target's
    distribution after it. Defaults are the paper's (epsilon 0.09, delta 0.3). Deviation: the paper's
    implementation takes the next token greedily at temperature 0; here greedy decoding uses ``greedy_verify``.
    """
    if parents is None:
        parents = torch.arange(-1, draft_tokens.shape[1] - 1, device=draft_tokens.device)
    tree = CandidateTree.build(draft_tokens, parents)
    at_parent = target_probs.gather(1, (tree.parents + 1)[..., None].expand(-1, -1, target_probs.shape[-1]))
    p_token = at_parent.gather(-1, draft_tokens[..., None])[..., 0]  # [B, N]
    entropy = -(at_parent * at_parent.clamp_min(1e-30).log()).sum(-1)  # [B, N]
    threshold = torch.clamp(posterior_alpha * torch.exp(-entropy), max=posterior_threshold)
    last = deepest_path(p_token > threshold, tree.parents, tree.depth)  # [B]
    rows = torch.arange(draft_tokens.shape[0], device=draft_tokens.device)
    nodes = torch.where((last >= 0)[:, None], tree.paths()[rows, last.clamp_min(0)], -1)  # [B, D]
    next_tokens = sample_tokens(target_probs[rows, last + 1], generator)
    return VerifyResult((nodes >= 0).sum(dim=1), nodes, next_tokens)
