"""Verification of drafted tokens against the target: pure tensor functions, no model, no cache.

Boundary: given draft tokens (and, for stochastic drafts, the distributions they were sampled from) and the
target's *processed* distributions at every draft position, decide per row how many draft tokens are kept and
which one extra token follows. Nothing here knows about caches, tokenizers or generation configs.

Glossary (follows Leviathan et al. 2211.17192, Alg. 1, and Chen et al. 2302.01318):
    draft token     a token proposed by the drafter (a chain of K, or the N nodes of a tree).
    accepted token  a draft token the target keeps; a row keeps the longest accepted path from the root.
    recovered token drawn from norm(max(0, target_probs - draft_probs)) at the first rejected position.
    bonus token     drawn from the target's distribution after the last draft token when every token was kept.
    next token      the recovered or bonus token: each round emits ``num_accepted + 1`` tokens per row.
    point mass      a deterministic drafter (greedy draft, n-gram lookup, Medusa/EAGLE top-k): its "distribution"
                    is one-hot, so a token x is kept with probability target_probs(x) and, on rejection, x is
                    removed from the target distribution before the next try. Needs no draft probabilities.
    target_probs    softmax of the target's processed scores; row ``n + 1`` is the distribution *after* node n,
                    row 0 the distribution after the last committed token (the tree's root).
    draft_probs     the processed distribution each draft token was actually sampled from.
    parents         ``[N]`` parent node of each tree node, ``-1`` for a child of the root, topologically
                    ordered (``parents[n] < n``), shared by every row; ``[B, N]`` gives each row its own tree
                    (EAGLE-2 dynamic trees; see ``tree.py``). ``None`` means a chain: ``parents[n] = n - 1``.

Shapes: ``B`` rows, ``K`` chain length, ``N`` tree nodes (a chain has ``N = K``), ``V`` vocabulary.

Both chains and trees go through the same rules: a chain has a vectorised fast path; a tree is walked node by
node (the reference, also used by tests to check the chain path). The greedy rule is the ``T -> 0`` limit of the
stochastic one, kept separate because it needs only argmax ids, not probabilities.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hf_kvspec.speculative.tree import tree_depth


@dataclass
class VerifyResult:
    """What a row keeps after one verification."""

    num_accepted: torch.Tensor  # [B] accepted draft tokens (depth of the accepted path)
    accepted_nodes: torch.Tensor  # [B, K_max] node index of the i-th accepted token; -1 past num_accepted
    next_tokens: torch.Tensor  # [B] recovered or bonus token

    def accepted_tokens(self, draft_tokens: torch.Tensor) -> torch.Tensor:
        """``[B, K_max]`` accepted draft ids along each row's path (entries past ``num_accepted`` are junk)."""
        return draft_tokens.gather(1, self.accepted_nodes.clamp_min(0))


def is_chain(parents: torch.Tensor | None, num_nodes: int) -> bool:
    """True when ``parents`` ([N] or [B, N]) is ``None`` or exactly the chain ``[-1, 0, 1, ...]`` in every row."""
    if parents is None:
        return True
    chain = torch.arange(-1, num_nodes - 1, device=parents.device)
    return parents.shape[-1] == num_nodes and bool((parents == chain).all())


def _chain_result(keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # keep [B, K] bool per position -> longest all-kept prefix; nodes of a chain are 0..n-1
    num_accepted = keep.long().cumprod(dim=-1).sum(dim=-1)
    positions = torch.arange(keep.shape[1], device=keep.device).expand_as(keep)
    nodes = torch.where(positions < num_accepted[:, None], positions, -1)
    return num_accepted, nodes


def greedy_verify(
    draft_tokens: torch.Tensor,  # [B, N]
    target_tokens: torch.Tensor,  # [B, N + 1] argmax of the processed target scores
    parents: torch.Tensor | None = None,  # [N] or [B, N]
) -> VerifyResult:
    """Greedy acceptance: keep the longest path on which every draft token equals the target's argmax."""
    if not is_chain(parents, draft_tokens.shape[1]):
        return _tree_greedy(draft_tokens, target_tokens, parents)
    num_draft = draft_tokens.shape[1]
    match = draft_tokens == target_tokens[:, :num_draft]
    num_accepted, nodes = _chain_result(match)
    next_tokens = target_tokens.gather(1, num_accepted[:, None]).squeeze(1)
    return VerifyResult(num_accepted, nodes, next_tokens)


def rejection_verify(
    draft_tokens: torch.Tensor,  # [B, N]
    target_probs: torch.Tensor,  # [B, N + 1, V]
    draft_probs: torch.Tensor | None = None,  # [B, N, V]; None = point-mass (deterministic) drafts
    parents: torch.Tensor | None = None,  # [N] or [B, N]
    generator: torch.Generator | None = None,
) -> VerifyResult:
    """Exact speculative sampling: the emitted tokens are distributed exactly as sampling from the target.

    Stochastic drafts keep token x with probability ``min(1, target_probs(x) / draft_probs(x))``; point-mass
    drafts (``draft_probs=None``) keep it with probability ``target_probs(x)``, which is the same rule with a
    one-hot ``draft_probs``.
    """
    if not is_chain(parents, draft_tokens.shape[1]):
        return _tree_rejection(draft_tokens, target_probs, draft_probs, parents, generator)
    batch, num_draft = draft_tokens.shape
    rows = torch.arange(batch, device=draft_tokens.device)
    p_token = target_probs[:, :num_draft].gather(-1, draft_tokens[..., None]).squeeze(-1)  # [B, K]
    q_token = (draft_probs.gather(-1, draft_tokens[..., None]).squeeze(-1) if draft_probs is not None
               else torch.ones_like(p_token))
    uniform = torch.rand(p_token.shape, generator=generator, device=p_token.device, dtype=p_token.dtype)
    keep = uniform * q_token < p_token  # u < p/q without dividing by a zero q
    num_accepted, nodes = _chain_result(keep)

    # Distribution of the next token: residual at the first rejection, target_probs after the chain (bonus).
    rejected = num_accepted < num_draft
    at = num_accepted.clamp(max=num_draft - 1) if num_draft else num_accepted
    p_next = target_probs[rows, num_accepted]  # [B, V]
    if num_draft:
        q_next = (draft_probs[rows, at] if draft_probs is not None
                  else _one_hot(draft_tokens[rows, at], p_next))
        p_next = torch.where(rejected[:, None], _residual(p_next, q_next), p_next)
    next_tokens = sample_tokens(p_next, generator)
    return VerifyResult(num_accepted, nodes, next_tokens)


def sample_tokens(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row of ``probs`` [B, V] (non-negative, need not sum to 1) -> ``[B]``.

    Inverse-CDF sampling with one uniform per row over float64 cumulative sums: exactly the categorical
    distribution (zero-probability tokens are never drawn), and on CPU ~15x cheaper than ``torch.multinomial``
    over a 49k vocabulary (~0.1 ms vs ~1.6 ms, which draws a random number per vocabulary entry); the speculative
    loop samples K + 1 times per round.
    """
    cdf = probs.double().cumsum(dim=-1)  # [B, V]
    uniform = torch.rand(cdf.shape[0], 1, generator=generator, dtype=cdf.dtype, device=cdf.device)
    return torch.searchsorted(cdf, uniform * cdf[:, -1:], right=True).squeeze(1).clamp_max(cdf.shape[1] - 1)


def _one_hot(tokens: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    # tokens [B] -> [B, V] in like's dtype
    return torch.zeros_like(like).scatter_(-1, tokens[:, None], 1.0)


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``norm(max(0, p - q))`` row-wise; falls back to ``p`` where rounding left no mass (p == q up to eps)."""
    residual = (p - q).clamp_min(0)
    total = residual.sum(-1, keepdim=True)
    return torch.where(total > 0, residual / total.clamp_min(torch.finfo(p.dtype).tiny), p)


# ---------------------------------------------------------------------------------------------- trees
def _tree(parents: torch.Tensor, draft_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``parents`` [N] or [B, N] -> (parents [B, N], depth [B, N] 1-based); refuses a non-topological order."""
    parents = parents.to(draft_tokens.device).expand(draft_tokens.shape)
    return parents, tree_depth(parents)


def _paths(parents: torch.Tensor, last: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
    # parents/depth [B, N]; last [B] deepest accepted node (-1 = root) -> [B, max depth] node ids from the root
    # down, -1 padded (one spare column absorbs the writes of rows whose walk reached the root)
    width = int(depth.max()) if depth.numel() else 0
    nodes = torch.full((last.shape[0], width + 1), -1, dtype=torch.long, device=last.device)
    node = last
    for _ in range(width):
        real = node >= 0
        column = torch.where(real, depth.gather(1, node.clamp_min(0)[:, None]).squeeze(1) - 1, width)
        nodes.scatter_(1, column[:, None], node[:, None])
        node = torch.where(real, parents.gather(1, node.clamp_min(0)[:, None]).squeeze(1), -1)
    return nodes[:, :width]


def deepest_path(ok: torch.Tensor, parents: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
    """``ok`` [B, N] node passes its own test -> ``[B]`` deepest node whose whole path passes (-1 = the root);
    among equal depths the first in node order (a tree of distinct siblings has one)."""
    batch, num_nodes = ok.shape
    accepted = torch.zeros(batch, num_nodes + 1, dtype=torch.bool, device=ok.device)
    accepted[:, 0] = True  # column 0 is the root, column n + 1 is node n
    for n in range(num_nodes):
        accepted[:, n + 1] = accepted.gather(1, parents[:, n:n + 1] + 1).squeeze(1) & ok[:, n]
    depth_col = torch.cat([depth.new_zeros(batch, 1), depth], dim=1)  # [B, N + 1]
    order = torch.arange(num_nodes + 1, device=ok.device)
    score = torch.where(accepted, depth_col * (num_nodes + 1) - order, -(num_nodes + 1) ** 2)
    return score.argmax(-1) - 1


def _tree_greedy(draft_tokens, target_tokens, parents) -> VerifyResult:
    parents, depth = _tree(parents, draft_tokens)
    ok = draft_tokens == target_tokens.gather(1, parents + 1)  # node equals the target's argmax after its parent
    last = deepest_path(ok, parents, depth)
    num_accepted = torch.where(last >= 0, depth.gather(1, last.clamp_min(0)[:, None]).squeeze(1), 0)
    next_tokens = target_tokens.gather(1, (last + 1)[:, None]).squeeze(1)
    return VerifyResult(num_accepted, _paths(parents, last, depth), next_tokens)


def _tree_rejection(draft_tokens, target_probs, draft_probs, parents, generator) -> VerifyResult:
    """Walk the tree in node order; siblings are tried in turn against the running residual (SpecInfer,
    Miao et al. 2305.09781, multi-step speculative sampling), children of an accepted node against its target
    distribution. Siblings of a stochastic tree must be drawn i.i.d. from their row of ``draft_probs``."""
    parents, depth = _tree(parents, draft_tokens)
    batch = draft_tokens.shape[0]
    rows = torch.arange(batch, device=draft_tokens.device)
    current = torch.full((batch,), -1, dtype=torch.long, device=draft_tokens.device)  # node each row sits on
    residual = target_probs[:, 0].clone()  # [B, V] what the row samples from if it stops here
    for n in range(draft_tokens.shape[1]):
        here = current == parents[:, n]
        if not bool(here.any()):
            continue
        token = draft_tokens[:, n]
        q = draft_probs[:, n] if draft_probs is not None else _one_hot(token, residual)
        p_token = residual[rows, token]
        q_token = q[rows, token]
        uniform = torch.rand(batch, generator=generator, device=residual.device, dtype=residual.dtype)
        keep = here & (uniform * q_token < p_token)
        reject = here & ~keep
        residual = torch.where(reject[:, None], _residual(residual, q), residual)
        residual = torch.where(keep[:, None], target_probs[:, n + 1], residual)
        current = torch.where(keep, n, current)
    num_accepted = torch.where(current >= 0, depth.gather(1, current.clamp_min(0)[:, None]).squeeze(1), 0)
    next_tokens = sample_tokens(residual, generator)
    return VerifyResult(num_accepted, _paths(parents, current, depth), next_tokens)
