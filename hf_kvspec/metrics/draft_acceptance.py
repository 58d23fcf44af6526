"""``evaluate`` metric: how often a draft head agrees with its target, and the tokens per target forward that implies.

Boundary: token ids in, numbers out. Running the head and the target is the caller's business
(``hf_kvspec.heads.evaluation.evaluate_head`` does it for our heads); this file knows nothing of models and imports
nothing from hf_kvspec, because ``evaluate.load`` copies it into its own module cache and imports that copy.

Terms, for one response of ``n`` tokens that the target produced greedily:

    references[t]         the target's greedy token at response step t (t = 0..n-1)
    predictions[k][t]     the head's draft at depth k made after step t, i.e. its guess for references[t + k + 1]
                          (depth 0 is the token after the target's own next token: Medusa head k, EAGLE step k).
                          Only t + k + 1 < n is scored; the value at other t is ignored (pass anything, e.g. -1).
    candidates            "tree" configuration only: predictions[k][t] is a ranked list of guesses, best first.
    per_head_top1[k]      share of scored rows where the depth-k draft (best guess) equals its reference.
    chain walk            greedy chain verification on the target's own text: from step t, accept the leading run
                          ``a`` of correct drafts (at most the depth that still lands inside the response), emit
                          ``a + 1`` tokens (the accepted drafts plus the target's own token), continue at t + a + 1.
    tau                   emitted tokens / target forwards of that walk (the response length / forwards).
    tree walk             the same walk, but the accepted length at step t is the deepest node of a static tree of
                          candidate ranks (Medusa's "choices", arXiv 2401.10774) on which every guess is right.

Teacher forcing: depth-k drafts are made as if depths 0..k-1 were right (EAGLE unrolls on the target's tokens). A
chain or tree never uses a draft after a wrong one, so the walk equals greedy speculative decoding on this text.
Papers: Leviathan et al. arXiv 2211.17192 (speculative decoding); Cai et al. 2401.10774; Li et al. 2401.15077.
"""

from __future__ import annotations

import datasets
import evaluate

_DESCRIPTION = """Per-depth top-1 agreement of a draft head (Medusa heads, an EAGLE drafter, any drafter that proposes
K tokens ahead) with its target model, and the tokens per target forward (tau) that greedy chain -- and, in the
"tree" configuration, static-tree -- speculative decoding would reach on the same text. One example is one response:
`references` are the target's greedy tokens, `predictions[k][t]` the depth-k draft made after step t."""

_KWARGS_DESCRIPTION = """
Args:
    predictions: per response, K lists of n draft token ids (configuration "chain", the default) or K lists of n
        ranked candidate lists (configuration "tree"). predictions[k][t] guesses references[t + k + 1].
    references: per response, the n token ids the target emitted greedily.
    tree: ("tree" configuration) a list of paths of candidate ranks, e.g. [[0], [1], [0, 0], [0, 1], [1, 0]];
        every prefix of a path must be in the list too. Default: the chain of best guesses.
Returns:
    per_head_top1: list of K floats; positions: list of K scored rows per depth;
    tau: chain tokens per target forward; emitted_tokens; target_forwards;
    ("tree" only) per_head_topk, tree_tau, tree_target_forwards.
Examples:
    >>> metric = hf_kvspec.load_metric("draft_acceptance")
    >>> metric.compute(predictions=[[[12, 13, 14, -1]]], references=[[11, 12, 13, 14]])["tau"]
    2.0
"""

_CITATION = """@inproceedings{leviathan2023fast,
  title = {Fast Inference from Transformers via Speculative Decoding},
  author = {Leviathan, Yaniv and Kalman, Matan and Matias, Yossi},
  booktitle = {International Conference on Machine Learning},
  year = {2023},
  note = {arXiv:2211.17192}
}
@article{cai2024medusa,
  title = {Medusa: Simple LLM Inference Acceleration Framework with Multiple Decoding Heads},
  author = {Cai, Tianle and Li, Yuhong and Geng, Zhengyang and Peng, Hongwu and Lee, Jason D. and Chen, Deming and
            Dao, Tri},
  journal = {arXiv preprint arXiv:2401.10774},
  year = {2024}
}
"""

_TOKENS = datasets.Sequence(datasets.Value("int64"))


class DraftAcceptance(evaluate.Metric):
    """Configurations: "chain" (default; one draft per depth and step) and "tree" (ranked candidates)."""

    def _info(self) -> evaluate.MetricInfo:
        drafts = datasets.Sequence(_TOKENS) if not self._is_tree else datasets.Sequence(datasets.Sequence(_TOKENS))
        return evaluate.MetricInfo(
            description=_DESCRIPTION, citation=_CITATION, inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features({"predictions": drafts, "references": _TOKENS}),
            reference_urls=["https://arxiv.org/abs/2211.17192", "https://arxiv.org/abs/2401.10774"])

    @property
    def _is_tree(self) -> bool:
        if self.config_name not in ("default", "chain", "tree"):
            raise ValueError(f"Unknown draft_acceptance configuration {self.config_name!r}: use 'chain' or 'tree'.")
        return self.config_name == "tree"

    def _compute(self, predictions, references, tree=None) -> dict:
        if tree is not None and not self._is_tree:
            raise ValueError("tree= is read by the 'tree' configuration only (the chain has no tree): "
                             "load_metric('draft_acceptance', 'tree'), with ranked candidate lists as predictions.")
        candidates = predictions if self._is_tree else [[[[d] for d in row] for row in p] for p in predictions]
        return acceptance(candidates, references, tree, with_tree=self._is_tree)


# -------------------------------------------------------------------------------------------------- pure functions
def acceptance(candidates: list, references: list, tree: list | None = None, with_tree: bool = False) -> dict:
    """The metric's result; candidates[i][k][t] is a ranked list of guesses (see the module docstring)."""
    if not candidates:
        raise ValueError("draft_acceptance got no responses: add(predictions=..., references=...) before compute().")
    depth = _common_depth(candidates)
    _check_references(references)
    paths = _tree_paths(tree, depth, _candidate_width(candidates))
    hits, topk_hits, counts = [0] * depth, [0] * depth, [0] * depth
    emitted = chain_forwards = tree_forwards = 0
    for drafts, refs in zip(candidates, references):
        ranks = rank_matrix(drafts, refs)                                   # ranks[k][t], rows inside the response
        for k, row in enumerate(ranks):
            hits[k] += sum(r == 0 for r in row)
            topk_hits[k] += sum(r >= 0 for r in row)
            counts[k] += len(row)
        emitted += len(refs)
        chain_forwards += walk_forwards(ranks, len(refs), lambda ranks_at_t: leading_run(ranks_at_t))
        tree_forwards += walk_forwards(ranks, len(refs), lambda ranks_at_t: deepest_node(ranks_at_t, paths))
    result = {"per_head_top1": _ratios(hits, counts), "tau": _ratio(emitted, chain_forwards), "positions": counts,
              "emitted_tokens": emitted, "target_forwards": chain_forwards}
    if with_tree:
        result.update(per_head_topk=_ratios(topk_hits, counts), tree_tau=_ratio(emitted, tree_forwards),
                      tree_target_forwards=tree_forwards)
    return result


def rank_matrix(drafts: list, references: list) -> list[list[int]]:
    """ranks[k][t] = position of references[t + k + 1] among drafts[k][t] (-1 when absent), for t + k + 1 < n."""
    n = len(references)
    for k, row in enumerate(drafts):
        if len(row) != n:
            raise ValueError(f"predictions[{k}] has {len(row)} steps but the response has {n} reference tokens: give "
                             "one draft (or candidate list) per response step, padding steps past the end with -1.")
    return [[_rank(drafts[k][t], references[t + k + 1]) for t in range(n - k - 1)] for k in range(len(drafts))]


def _rank(guesses: list, token: int) -> int:
    return guesses.index(token) if token in guesses else -1


def walk_forwards(ranks: list[list[int]], n: int, accepted_length) -> int:
    """Target forwards to emit all n tokens when step t accepts ``accepted_length(ranks at t)`` drafts."""
    forwards, t = 0, 0
    while t < n:
        usable = min(len(ranks), n - 1 - t)                       # depths whose draft lands inside the response
        accepted = accepted_length([ranks[k][t] for k in range(usable)])
        forwards += 1
        t += accepted + 1
    return forwards


def leading_run(ranks_at_t: list[int]) -> int:
    """Chain: number of leading depths whose best guess is right (rank 0)."""
    run = 0
    for rank in ranks_at_t:
        if rank != 0:
            break
        run += 1
    return run


def deepest_node(ranks_at_t: list[int], paths: set[tuple[int, ...]]) -> int:
    """Tree: depth of the deepest tree node on the path of right guesses (prefix-closed tree, so stop at a miss)."""
    accepted = 0
    while accepted < len(ranks_at_t) and tuple(ranks_at_t[:accepted + 1]) in paths:
        accepted += 1
    return accepted


def _tree_paths(tree: list | None, depth: int, width: int) -> set[tuple[int, ...]]:
    """The tree as a set of rank paths; refused when a path could never be walked on these predictions."""
    if tree is None:
        return {(0,) * d for d in range(1, depth + 1)}
    paths = {tuple(path) for path in tree}
    if any(not path or min(path) < 0 for path in paths):
        raise ValueError(f"tree paths are non-empty lists of candidate ranks >= 0 (0 = best guess), e.g. [[0], [1], "
                         f"[0, 0]]; got {sorted(p for p in paths if not p or min(p) < 0)[:3]}.")
    orphans = [p for p in paths if len(p) > 1 and p[:-1] not in paths]
    if orphans:
        raise ValueError(f"tree paths {sorted(orphans)[:3]} lack their parent path; list every prefix of a path.")
    deep = max(paths, key=len)
    if len(deep) > depth:
        raise ValueError(f"tree path {list(deep)} is {len(deep)} deep but the predictions give {depth} depths: "
                         f"draft {len(deep)} depths or drop the deeper paths.")
    wide = max(paths, key=max)
    if max(wide) >= width:
        raise ValueError(f"tree path {list(wide)} uses candidate rank {max(wide)} but the predictions rank at most "
                         f"{width} candidates per step: give more candidates or drop the wider paths.")
    return paths


def _candidate_width(candidates: list) -> int:
    """The most candidates any step ranks."""
    return max((len(guesses) for drafts in candidates for row in drafts for guesses in row), default=0)


def _check_references(references: list) -> None:
    """Token ids are >= 0 (-1 pads predictions, and would match it); a response has at least one token."""
    for i, refs in enumerate(references):
        if not len(refs):
            raise ValueError(f"references[{i}] is empty: a response without tokens has nothing to score; drop it "
                             "(and its predictions).")
        bad = next((t for t, token in enumerate(refs) if token < 0), None)
        if bad is not None:
            raise ValueError(f"references[{i}][{bad}] = {refs[bad]}: references are the target's token ids >= 0 "
                             "(-1 pads predictions only); cut the response before padding instead of padding it.")


def _common_depth(candidates: list) -> int:
    depths = {len(drafts) for drafts in candidates}
    if len(depths) > 1:
        raise ValueError(f"responses were drafted to different depths {sorted(depths)}: use one depth per metric.")
    return depths.pop() if depths else 0


def _ratio(numerator: int, denominator: int) -> float:
    return numerator / denominator if denominator else float("nan")


def _ratios(numerators: list[int], denominators: list[int]) -> list[float]:
    return [_ratio(a, b) for a, b in zip(numerators, denominators)]
