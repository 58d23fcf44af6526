"""How one round's drafts meet the target: a chain or a tree, behind the same four steps.

Boundary: the tensor work of one speculative round that depends on the *shape* of the proposal: the target forward's
inputs (ids, mask, positions), the processed scores at every node, acceptance (``verify.py``) and the hidden states
of the kept path. ``round.py`` strings them into the round both the loop and the engine run (accept, then the
columns the cache keeps) and never branches on the shape; the callers own the model call, the cache object, the
stopper and the output.

Glossary (on top of ``verify.py``'s):
    root        the newest committed token (the buffer's last column, not yet in the cache). Score row 0 is the
                target's distribution after it.
    node n      draft token n; ``parents[n]`` is its parent node, ``-1`` the root. Score row ``n + 1``.
    path of n   the nodes from the root's child down to n, n included; ``depth[n]`` is its length (1-based).
    ancestors   ``[A, N, N]`` bool, ``ancestors[b, n, m]``: node m is on node n's path (n itself included).
    kept columns ``[A, 1 + k]`` which columns of the verified segment (0 = root, ``1 + n`` = node n) survive.

A chain is the tree ``parents = [-1, 0, 1, ...]``; it keeps the fast path: one forward over the root and the
drafts with the buffer's 2D mask, one processor call for all positions, ``crop(-k)``.

A tree is verified by one forward over the root plus the N nodes, flattened in node order, with an explicit 4D mask
and positions (root position + depth); afterwards only each row's accepted path survives in the cache
(``cache.contract.keep_positions``). Worked example, one row, tree ``a -> {b, c}``, ``b -> {d}`` drafted after the
committed prefix ``x y`` (root ``y`` at position 1, cache holds ``x``)::

    tokens  = [a, b, c, d]          parents = [-1, 0, 0, 1]       depth = [1, 2, 2, 3]
    forward ids  = [y, a, b, c, d]  positions = [1, 2, 3, 3, 4]
    mask rows (key columns x | y a b c d):   y: 1|1 . . . .   a: 1|1 1 . . .   b: 1|1 1 1 . .
                                             c: 1|1 1 . 1 .   d: 1|1 1 1 . 1
    target greedy after y, a, b = a, b, d  -> accepted path [a, b, d] (nodes 0, 1, 3), next token = argmax after d
    kept columns = [0, 1, 2, 4] -> cache x y a b d; the buffer appends a b d + next, as for the chain a b d.

Row ``b``'s 2D prefix mask (left padding and the holes of earlier rounds) masks the prefix columns of every query.
Logits processors see, at node n, exactly the ``input_ids`` plain ``generate`` would pass after emitting n's path:
the row's history followed by the path's tokens (``path_scores``).

Every tensor here holds the active rows only (``rows.py``): the loop never hands a round the call's other rows.

Shapes: ``A`` active rows, ``N`` nodes, ``D`` deepest path, ``S`` cached columns, ``W`` buffer width, ``V``
vocabulary, ``H`` hidden size.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hf_kvspec.masking import pad_keys
from hf_kvspec.speculative.drafters.base import DraftProposal
from hf_kvspec.speculative.positions import History, PositionwiseProcessor
from hf_kvspec.speculative.tree import CandidateTree, keep_indices, tree_depth
from hf_kvspec.speculative.verify import VerifyResult, greedy_verify, is_chain, rejection_verify

#: a drafter's own acceptance rule under sampling: ``(draft_tokens [A, N], target_probs [A, N + 1, V], parents
#: [N] | [A, N] | None, generator) -> VerifyResult`` (``MedusaAssistant.verify`` for typical acceptance)
AcceptanceRule = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None", "torch.Generator | None"], VerifyResult]

# Attention implementations that take a custom 4D mask as transformers passes it (as-is, additive float):
# sdpa and eager get 4D masks from transformers' own mask builders; flex adds a tensor mask as a score_mod (not
# exercised by our tests: flex does not run on the CPU build we test with); ours honour a caller's 4D mask (cache
# contract, tests/speculative/test_tree_loop.py). flash-attention kernels take 2D padding masks only, and
# transformers' continuous-batching ``paged|...`` functions read their own cache.
TREE_ATTENTION = ("sdpa", "eager", "flex_attention", "kvspec_gqa", "kvspec_paged", "kvspec_quant")


def check_tree_attention(attn_implementation: str | None) -> None:
    """Refuse an attention implementation that cannot take a tree's custom 4D mask, naming the ones that can."""
    name = attn_implementation or "eager"
    if "flash" in name or name.startswith("paged|"):
        raise ValueError(
            f"tree verification needs an attention implementation that takes a custom 4D mask; {name!r} does not "
            f"(flash-attention kernels read 2D padding masks only). Load the target with attn_implementation= one "
            f"of {', '.join(TREE_ATTENTION)} (model.set_attn_implementation('sdpa')), or use a chain drafter.")


def is_tree(proposal: DraftProposal) -> bool:
    """Whether ``proposal`` needs tree verification: per-row parents, or shared parents that are not a chain."""
    return not is_chain(proposal.parents, proposal.tokens.shape[1])


def cap_proposal(proposal: DraftProposal, max_depth: int, max_nodes: int | None = None) -> DraftProposal:
    """``proposal`` [A, N] with no path deeper than ``max_depth`` drafts and at most ``max_nodes`` nodes: unchanged
    when it fits, else its first nodes (a prefix of a topological node list is a tree, at most as deep as it is
    long). Drafters that read ``DraftContext.max_depth`` fit already; this guards the others against overshooting
    max_length, and the engine's against overshooting the slots a request was granted."""
    count = proposal.tokens.shape[1]
    keep = count if max_nodes is None else min(count, max_nodes)
    if keep > max_depth:
        parents = proposal.parents
        deep = parents is None or int(tree_depth(parents[..., :keep]).max()) > max_depth
        keep = max_depth if deep else keep
    if keep == count:
        return proposal
    probs, parents = proposal.probs, proposal.parents
    return DraftProposal(proposal.tokens[:, :keep], None if probs is None else probs[:, :keep],
                         None if parents is None else parents[..., :keep], proposal.draft_forwards)


def keep_nodes(proposal: DraftProposal, keep: list[bool]) -> DraftProposal:
    """``proposal`` (one row, ``[1, N]``) without the nodes where ``keep`` is False, nor their descendants (a
    path through a dropped node is dropped); parents re-indexed. A chain keeps its prefix up to the first drop."""
    parents = None if proposal.parents is None else proposal.parents.reshape(-1).tolist()  # [N]
    kept: list[int] = []
    for node, wanted in enumerate(keep):
        parent = node - 1 if parents is None else parents[node]
        if wanted and (parent < 0 or parent in kept):
            kept.append(node)
        elif parents is None:
            break
    if len(kept) == len(keep):
        return proposal
    index = torch.tensor(kept, dtype=torch.long, device=proposal.tokens.device)
    probs = None if proposal.probs is None else proposal.probs.index_select(1, index)
    new_parents = None
    if parents is not None:
        position = {node: i for i, node in enumerate(kept)}
        new_parents = torch.tensor([position.get(parents[node], -1) for node in kept],
                                   dtype=proposal.parents.dtype, device=proposal.parents.device)
        new_parents = new_parents.view(*proposal.parents.shape[:-1], len(kept))
    return DraftProposal(proposal.tokens.index_select(1, index), probs, new_parents, proposal.draft_forwards)


def plan_round(proposal: DraftProposal) -> ChainRound | TreeRound:
    """The round for ``proposal`` (``[A, N]``): a ``TreeRound`` unless it is a chain."""
    return TreeRound(proposal) if is_tree(proposal) else ChainRound(proposal)


class ChainRound:
    """N drafts in a line: the forward feeds the root and the drafts under the buffer's mask."""

    is_tree = False

    def __init__(self, proposal: DraftProposal):
        self.proposal = proposal
        self.num_draft = proposal.tokens.shape[1]
        self.depth = self.num_draft  # deepest path (telemetry counts acceptance per depth)

    def forward_inputs(self, buffer, cache, dtype) -> dict:
        """Model kwargs over the root (the buffer's last column) and the drafts; all their logits are kept."""
        count = self.num_draft + 1
        return dict(input_ids=torch.cat([buffer.tokens[:, -1:], self.proposal.tokens], dim=1),  # [A, N + 1]
                    attention_mask=buffer.attention_mask(count), position_ids=buffer.next_positions(count),
                    logits_to_keep=count)

    def scores(self, processor: PositionwiseProcessor, history: History, logits: torch.Tensor) -> torch.Tensor:
        # logits [A, N + 1, V] -> processed float32 scores; position t follows the first t drafts
        return processor(history, self.proposal.tokens, logits)

    def verify(self, scores: torch.Tensor, do_sample: bool, rule: AcceptanceRule | None = None,
               generator: torch.Generator | None = None) -> VerifyResult:
        return _verify(self.proposal, None, scores, do_sample, rule, generator)

    def path_hidden(self, hidden: torch.Tensor | None, accepted_nodes: torch.Tensor, longest: int):
        """[A, N + 1, H] unchanged: row i's newest feature is ``hidden[i, num_accepted[i]]``."""
        return hidden


class TreeRound:
    """N drafts in a tree (``parents`` [N] shared by all rows, or [A, N] per row): see the module docstring."""

    is_tree = True

    def __init__(self, proposal: DraftProposal):
        self.proposal = proposal
        self.num_draft = proposal.tokens.shape[1]
        self.tree = CandidateTree.build(proposal.tokens, proposal.parents)  # [A, N] tokens, parents, depth
        self.depth = self.tree.max_depth  # deepest path (telemetry counts acceptance per depth)

    def forward_inputs(self, buffer, cache, dtype) -> dict:
        """Model kwargs over the root and the nodes (the cache holds the buffer's other ``W - 1`` columns)."""
        tree = self.tree
        count = self.num_draft + 1
        mask = tree.attention_mask(buffer.mask[:, :-1], dtype)  # [A, 1, N + 1, W + N]
        if cache is not None:  # a static cache's keys are longer than what is written: mask its free slots
            mask = pad_keys(mask, cache.get_mask_sizes(count, 0)[0])
        return dict(input_ids=torch.cat([buffer.tokens[:, -1:], tree.tokens], dim=1), attention_mask=mask,
                    position_ids=tree.position_ids(buffer.positions[:, -1]), logits_to_keep=count)

    def scores(self, processor: PositionwiseProcessor, history: History, logits: torch.Tensor) -> torch.Tensor:
        return path_scores(processor, history, self.tree, logits)

    def verify(self, scores: torch.Tensor, do_sample: bool, rule: AcceptanceRule | None = None,
               generator: torch.Generator | None = None) -> VerifyResult:
        return _verify(self.proposal, self.tree.shared_parents(), scores, do_sample, rule, generator)

    def path_hidden(self, hidden: torch.Tensor | None, accepted_nodes: torch.Tensor, longest: int):
        """[A, N + 1, H] in node order -> [A, 1 + longest, H] along each row's path (root first)."""
        if hidden is None:
            return None
        columns = keep_indices(accepted_nodes[:, :longest])  # [A, 1 + longest]
        return hidden.gather(1, columns[..., None].expand(-1, -1, hidden.shape[-1]))


def _verify(proposal: DraftProposal, parents, scores: torch.Tensor, do_sample: bool,
            rule: AcceptanceRule | None, generator: torch.Generator | None = None) -> VerifyResult:
    """Greedy: the deepest path equal to the target's argmax (always exact). Sampling: speculative sampling
    (exact), or a drafter's own ``rule`` (a lossy one such as Medusa's typical acceptance, asked for by name),
    drawing from ``generator`` (a request's own; its draws run on the generator's device)."""
    draft_tokens = proposal.tokens.to(scores.device)
    if not do_sample:
        return greedy_verify(draft_tokens, scores.argmax(dim=-1), parents)
    target_probs = torch.softmax(scores, dim=-1)  # [A, N + 1, V]
    if rule is not None and proposal.tokens.shape[1]:  # no drafts: a plain sample from the target, any rule
        return rule(draft_tokens, target_probs, parents, generator)
    draft_probs = proposal.probs
    if generator is not None and generator.device != target_probs.device:
        device = generator.device
        target_probs, draft_tokens = target_probs.to(device), draft_tokens.to(device)
        draft_probs = None if draft_probs is None else draft_probs.to(device)
        parents = None if parents is None else parents.to(device)
    return rejection_verify(draft_tokens, target_probs, draft_probs, parents, generator)


# ---------------------------------------------------------------------------------------------- tree tensors
def path_tokens(tree: CandidateTree, pad_token_id: int) -> torch.Tensor:
    """``[A, N, D]`` the tokens of each node's path, root side first (``pad_token_id`` past the node's depth)."""
    paths = tree.paths()  # [A, N, D] node ids, -1 padded
    flat = paths.clamp_min(0).flatten(1)  # [A, N * D]
    tokens = tree.tokens.gather(1, flat).view(paths.shape)
    return torch.where(paths >= 0, tokens, pad_token_id)


def path_scores(processor: PositionwiseProcessor, history: History, tree: CandidateTree,
                logits: torch.Tensor) -> torch.Tensor:
    """Processed float32 scores ``[A, 1 + N, V]`` of ``logits`` [A, 1 + N, V]: row 0 after each row's history,
    row ``n + 1`` after the history followed by node n's path (what plain ``generate`` would pass there).

    The reference is one processor call per node with the history extended by that node's path; when every
    processor reads the scores only, one call covers all nodes (the fast path, checked against the reference)."""
    none = tree.tokens[:, :0]
    if not processor or all(processor.score_only):
        return processor(history, none, logits)
    return path_scores_per_node(processor, history, tree, logits)


def path_scores_per_node(processor: PositionwiseProcessor, history: History, tree: CandidateTree,
                         logits: torch.Tensor) -> torch.Tensor:
    """``path_scores`` one node at a time, each node's path appended to the history (the reference)."""
    none = tree.tokens[:, :0]
    paths = path_tokens(tree, history.pad_token_id)  # [A, N, D]
    columns = [processor(history, none, logits[:, :1])]
    for n in range(tree.num_nodes):
        columns.append(processor(history.along(paths[:, n], tree.depth[:, n]), none, logits[:, n + 1: n + 2]))
    return torch.cat(columns, dim=1)
