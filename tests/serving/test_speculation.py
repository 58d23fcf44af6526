"""Speculation inside the engine: each request's greedy output equals ``generate(do_sample=False)`` on its prompt
alone with chain drafters (n-gram, a draft model that is the target itself: always right) and tree drafters (an
oracle tree whose right branch is never the first node, so the kept path is moved in the cache; a random EAGLE
head and random Medusa heads: almost always wrong) under joins, leaves, chunked prefill, prefix hits, preemption,
cancellation and up to 16 rows; the pool is full after every scenario; drafts count in the token budget; seeded
sampling with drafts keeps the model's distribution (total variation on a tiny vocabulary)."""

from __future__ import annotations

import itertools

import pytest
import torch

from hf_kvspec.heads.configuration import EagleConfig, MedusaConfig
from hf_kvspec.heads.modeling_eagle import EagleHead
from hf_kvspec.heads.modeling_medusa import MedusaHeads
from hf_kvspec.serving.engine import Engine
from hf_kvspec.serving.request import FinishReason
from hf_kvspec.speculative.drafters.base import Assistant, DraftProposal
from hf_kvspec.speculative.drafters.draft_model import DraftModelAssistant
from hf_kvspec.speculative.drafters.eagle import EagleAssistant
from hf_kvspec.speculative.drafters.medusa import MedusaAssistant
from hf_kvspec.speculative.drafters.ngram import NgramAssistant
from hf_kvspec.speculative.drafters.quantized_self import QuantizedSelfAssistant
from hf_kvspec.speculative.drafters.suffix import SuffixAssistant
from hf_kvspec.speculative.suffix_pool import SuffixPool
from tests.tiny_models import randomized, tiny_model

from .helpers import assert_pool_full, greedy_reference, random_prompts, run_to_end, run_with_arrivals

VOCAB = 12  # prompts over few ids repeat n-grams, so the n-gram drafter proposes often
#: these tests check the verify rows' mechanics, so every decoding request drafts (the goodput choice would
#: rightly stop drafting on a tiny model); test_draft_lengths.py runs the goodput choice
DRAFT_LENGTHS = "fixed"


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


class OracleTree(Assistant):
    """Drafts a tree around the target's own greedy continuation (computed without a cache): node 0 is a wrong
    child of the root, the right path runs through node 1, and every right node also gets a wrong sibling. The
    accepted path is never a prefix of the node order, so the engine must move it in the cache."""

    proposes_trees = True

    def __init__(self, target, depth: int = 3):
        super().__init__(num_draft_tokens=2 * depth)
        self.target, self.depth = target, depth

    def propose(self, ctx):
        ids = ctx.history.ids[:1, : int(ctx.history.lengths[0])]
        right = []
        with torch.no_grad():
            for _ in range(min(self.depth, ctx.max_depth or self.depth)):
                right.append(int(self.target(torch.cat([ids, torch.tensor([right], dtype=torch.long)], 1)
                                             if right else ids).logits[0, -1].argmax()))
        vocab = self.target.config.vocab_size
        tokens, parents, right_at = [(right[0] + 1) % vocab, right[0]], [-1, -1], 1  # wrong first, then right
        for token in right[1:]:  # below the right node: the right child, then a wrong sibling
            tokens += [token, (token + 1) % vocab]
            parents += [right_at, right_at]
            right_at = len(tokens) - 2
        return DraftProposal(torch.tensor([tokens]), None, torch.tensor([parents]))



def make_assistant(kind, target):
    if "+" in kind:  # the suffix pool and a model drafter, chosen per request and round
        return [make_assistant(part, target) for part in kind.split("+")]
    if kind == "ngram":
        return NgramAssistant(num_draft_tokens=4)
    if kind == "draft_model":  # the target drafting for itself: every greedy draft is right
        return DraftModelAssistant(target, num_draft_tokens=3)
    if kind == "oracle_tree":
        return OracleTree(target)
    if kind == "self_int8":  # batched self-drafting from an int8 copy, on the engine's own paged cache
        return QuantizedSelfAssistant(target, "int8")
    if kind in ("suffix", "suffix_chain"):  # the engine's pool: trees of the most frequent continuations, or chains
        return SuffixAssistant(pool=SuffixPool(share_unsalted=True), tree=kind == "suffix", min_prob=0.05)
    if kind == "eagle":
        head = randomized(EagleHead(EagleConfig.for_base_model(target, "tiny")), 2, 0.2)
        return EagleAssistant(head, depth=3, top_k=2, total_tokens=6, num_draft_tokens=None, draft_vocab_size=None)
    heads = randomized(MedusaHeads(MedusaConfig.for_base_model(target, "tiny", num_heads=3)), 1, 0.3)
    return MedusaAssistant(heads, tree=[(0,), (1,), (0, 0), (2,), (0, 1), (0, 0, 0)], num_draft_tokens=None,
                           draft_vocab_size=None)


DRAFTERS = ["ngram", "draft_model", "oracle_tree", "eagle", "medusa", "self_int8", "suffix", "suffix_chain",
            "suffix+eagle", "suffix+draft_model"]


def check_outputs(engine, model, ids, prompts, max_new) -> list:
    outputs = []
    for request_id, prompt, n in zip(ids, prompts, max_new if isinstance(max_new, list) else itertools.repeat(max_new)):
        outputs.append(engine.get_output(request_id))
        assert outputs[-1].output_ids == greedy_reference(model, prompt, n), f"request {request_id}"
        assert outputs[-1].finish_reason in (FinishReason.LENGTH, FinishReason.EOS)
    return outputs


def drafted_and_accepted(engine):
    return sum(r.num_draft_tokens for r in engine.stats.rounds), sum(r.num_accepted for r in engine.stats.rounds)


@pytest.mark.parametrize("lengths", ["fixed", "goodput"])
@pytest.mark.parametrize("kind", DRAFTERS)
def test_joins_and_leaves(llama, kind, lengths):
    prompts = random_prompts([6, 21, 3, 14, 30, 8, 11], seed=1, vocab=VOCAB)
    max_new = [4, 12, 7, 16, 5, 9, 13]
    engine = Engine(llama, draft_lengths=lengths, kv_budget=128, block_size=4, max_tokens_per_round=32, max_running=4,
                    assistant=make_assistant(kind, llama))
    ids = run_with_arrivals(engine, prompts, max_new, {0: [0, 1], 2: [2], 3: [3, 4], 7: [5], 9: [6]})
    outputs = check_outputs(engine, llama, ids, prompts, max_new)
    drafted, accepted = drafted_and_accepted(engine)
    assert drafted > 0 or lengths == "goodput"  # goodput may rightly not draft (costs measured by earlier tests)
    if kind in ("draft_model", "oracle_tree") and lengths == "fixed":  # always right: every request gains
        assert accepted > 0 and all(out.metrics.tau > 1 for out in outputs)
    if kind == "self_int8" and lengths == "fixed":  # the int8 copy mostly agrees with its fp32 original
        assert accepted > drafted // 2
    assert_pool_full(engine)


@pytest.mark.parametrize("kind", DRAFTERS)
def test_sixteen_rows_with_chunked_prefill(llama, kind):
    prompts = random_prompts([3 + 2 * i for i in range(16)], seed=3, vocab=VOCAB)
    engine = Engine(llama, draft_lengths=DRAFT_LENGTHS, kv_budget=256, block_size=8, max_tokens_per_round=48, max_running=16,
                    assistant=make_assistant(kind, llama))
    ids = [engine.add_request(p, max_new_tokens=40) for p in prompts]
    run_to_end(engine)
    check_outputs(engine, llama, ids, prompts, 40)
    assert max(r.num_rows for r in engine.stats.rounds) == 16
    assert max(r.num_tokens for r in engine.stats.rounds) <= 48
    assert any(r.num_draft_tokens and r.num_rows > r.num_decode_rows for r in engine.stats.rounds), \
        "drafts never shared a round with a prefill chunk"
    assert_pool_full(engine)


@pytest.mark.parametrize("kind", DRAFTERS)
def test_prefix_hits_preemption_and_cancellation(llama, kind):
    """A shared system prompt (prefix hits: no features for the cached columns), a pool far smaller than the
    batch's peak (preemption and recompute, drafter states restarted) and two cancellations."""
    system = random_prompts([16], seed=4, vocab=VOCAB)[0]
    prompts = [system + tail for tail in random_prompts([3, 7, 5, 9, 4, 6], seed=5, vocab=VOCAB)]
    engine = Engine(llama, draft_lengths=DRAFT_LENGTHS, kv_budget=14, block_size=4, max_tokens_per_round=24, max_running=6,
                    assistant=make_assistant(kind, llama))
    first = engine.add_request(prompts[0], max_new_tokens=20)
    run_to_end(engine)
    ids = [first] + [engine.add_request(p, max_new_tokens=20) for p in prompts[1:]]
    for _ in range(3):
        engine.step()
    engine.cancel(ids[2])
    engine.cancel(ids[5])
    run_to_end(engine)
    assert engine.stats.num_preemptions > 0
    assert engine.get_output(ids[1], forget=False).metrics.cached_prompt_tokens == 16
    kept = [i for i in range(len(ids)) if i not in (2, 5)]
    check_outputs(engine, llama, [ids[i] for i in kept], [prompts[i] for i in kept], 20)
    for i in (2, 5):
        cancelled = engine.get_output(ids[i])
        assert cancelled.finish_reason is FinishReason.CANCELLED
        assert cancelled.output_ids == greedy_reference(llama, prompts[i], 20)[: len(cancelled.output_ids)]
    assert_pool_full(engine)


def test_drafts_count_in_the_budget_and_crowded_rounds_grant_fewer(llama):
    """Four decode rows and a budget of 8: four decode tokens, then draft slots in policy order (FIFO) — the first
    request gets all four it wants, the others none; no round exceeds the budget."""
    prompts = random_prompts([5, 6, 7, 8], seed=9, vocab=VOCAB)
    engine = Engine(llama, draft_lengths=DRAFT_LENGTHS, kv_budget=128, block_size=4, max_tokens_per_round=8, max_running=4,
                    assistant=DraftModelAssistant(llama, num_draft_tokens=4))
    ids = [engine.add_request(p, max_new_tokens=16) for p in prompts]
    run_to_end(engine)
    outputs = check_outputs(engine, llama, ids, prompts, 16)
    rounds = list(engine.stats.rounds)
    assert max(r.num_tokens for r in rounds) <= 8
    assert any(r.num_decode_rows == 4 and r.num_draft_tokens == 4 and r.num_tokens == 8 for r in rounds)
    taus = [out.metrics.tau for out in outputs]
    assert taus[0] > 1 and taus[0] > taus[-1]
    assert_pool_full(engine)


def test_a_failed_round_drops_its_drafters_and_the_engine_carries_on(llama):
    """A logits processor raises once in a speculative round: nothing advances, the drafter states of that
    round are dropped and begin again later (the round is re-run request by request, where the passing failure
    does not recur); every output is still the plain greedy one."""
    calls = {"n": 0}

    def flaky(input_ids, scores):
        calls["n"] += 1
        if calls["n"] == 12:
            raise RuntimeError("flaky processor")
        return scores

    prompts = random_prompts([7, 12, 9], seed=10, vocab=VOCAB)
    engine = Engine(llama, draft_lengths=DRAFT_LENGTHS, kv_budget=64, block_size=4, max_tokens_per_round=32, max_running=3,
                    assistant=make_assistant("eagle", llama))
    ids = [engine.add_request(p, max_new_tokens=12, logits_processor=[flaky] if i == 1 else ())
           for i, p in enumerate(prompts)]
    dropped, drop = [], engine.drafts.drafters.drop
    engine.drafts.drafters.drop = lambda request: (dropped.append((calls["n"], request.request_id)), drop(request))[1]
    run_to_end(engine)  # never raises: the culprit's own re-run succeeds
    assert calls["n"] > 12 and (12, ids[1]) in dropped
    check_outputs(engine, llama, ids, prompts, 12)
    assert_pool_full(engine)


def test_refusals_name_the_fix(llama):
    class SelfDrafter(NgramAssistant):
        shares_target_cache = True

    with pytest.raises(ValueError, match="self-speculation"):
        Engine(llama, kv_budget=16, assistant=SelfDrafter())
    with pytest.raises(ValueError, match="acceptance='exact'"):
        heads = MedusaHeads(MedusaConfig.for_base_model(llama, "tiny", num_heads=2))
        Engine(llama, kv_budget=16, assistant=MedusaAssistant(heads, tree="chain", acceptance="typical",
                                                              draft_vocab_size=None))
    with pytest.raises(ValueError, match="sliding-window"):
        Engine(tiny_model("mistral"), kv_budget=16, assistant=OracleTree(llama))


# ---------------------------------------------------------------------------------------------- sampling
class FixedChain(Assistant):
    """Always drafts the same chain (a point mass), so every round verifies drafts the target rarely agrees with."""

    def propose(self, ctx):
        return DraftProposal(torch.tensor([[3, 4, 3][: ctx.num_draft_tokens]]))


def exact_last_two(model, prompt, temperature) -> dict[tuple[int, int], float]:
    """P(t2, t3) of three sampled tokens (t1 summed out), with plain torch softmax(logits / T)."""
    def dist(ids):
        with torch.no_grad():
            return torch.softmax(model(torch.tensor([ids])).logits[0, -1].double() / temperature, dim=-1)

    first, out = dist(prompt), {}
    for a in range(len(first)):
        second = dist([*prompt, a])
        for b in range(len(second)):
            third = dist([*prompt, a, b])
            for c in range(len(third)):
                out[(b, c)] = out.get((b, c), 0.0) + float(first[a] * second[b] * third[c])
    return out


@pytest.mark.parametrize("kind", ["point_mass", "suffix", pytest.param("draft_model", marks=pytest.mark.slow)])  # ~10 s
def test_sampling_with_drafts_keeps_the_models_distribution_tv(kind):
    """Three sampled tokens per request: the last two come from a verify round (point-mass drafts, a suffix pool's
    drafts from the samples of earlier requests, or a draft model's sampled drafts with their probabilities);
    their joint law is the target's."""
    model = tiny_model("llama", vocab_size=6, seed=3)
    with torch.no_grad():  # a random tiny model is nearly uniform; sharpen it so the law has structure
        model.lm_head.weight.mul_(6)
    draft = tiny_model("llama", vocab_size=6, seed=4)
    assistant = {"point_mass": lambda: FixedChain(num_draft_tokens=2), "draft_model": lambda: DraftModelAssistant(draft, 2),
                 "suffix": lambda: SuffixAssistant(pool=SuffixPool(share_unsalted=True), num_draft_tokens=2,
                                                   min_prob=0.05)}[kind]()
    prompt, temperature, draws = [3, 5, 4, 1, 2], 0.8, 3000
    engine = Engine(model, draft_lengths=DRAFT_LENGTHS, kv_budget=1024, block_size=4, max_tokens_per_round=384, max_running=128,
                    assistant=assistant)
    ids = [engine.add_request(prompt, max_new_tokens=3, do_sample=True, temperature=temperature, seed=seed,
                              eos_token_id=[]) for seed in range(draws)]
    run_to_end(engine)
    counts: dict[tuple[int, int], int] = {}
    for request_id in ids:
        pair = tuple(engine.get_output(request_id).output_ids[1:])
        counts[pair] = counts.get(pair, 0) + 1
    target = exact_last_two(model, prompt, temperature)
    drafted, accepted = drafted_and_accepted(engine)
    # drafts were verified, some kept, some rejected (the pool has nothing to draft for the first requests)
    assert drafted >= (draws // 2 if kind == "suffix" else draws) and 0 < accepted < drafted
    tv = 0.5 * sum(abs(counts.get(pair, 0) / draws - p) for pair, p in target.items())
    # 36 outcomes, 3000 draws: E[TV] <= 0.5·sqrt(2·36/(pi·3000)) ~ 0.044, spread ~0.01. Accepting every point-mass
    # draft (no rejection step) puts ~all mass on (3, 4): TV > 0.5; 0.08 leaves four spreads of margin.
    assert tv < 0.08, f"TV {tv:.3f}"
    assert_pool_full(engine)


def test_generate_batch_with_the_target_as_its_own_draft_model(llama):
    """generate_batch holds the runner's set-up across rounds; a draft model that is the target itself must still
    run with its own attention there (the hold keeps the kernels only when the engine has an assistant)."""
    prompts = random_prompts([5, 9, 7], seed=3)
    engine = Engine(llama, None, draft_lengths=DRAFT_LENGTHS, kv_budget=64, block_size=4, max_tokens_per_round=32, max_running=4,
                    assistant=DraftModelAssistant(llama, num_draft_tokens=3))
    outputs = engine.generate_batch(prompts, max_new_tokens=6, progress_bar=False)
    assert [o.output_ids for o in outputs] == [greedy_reference(llama, p, 6) for p in prompts]
    assert_pool_full(engine)
