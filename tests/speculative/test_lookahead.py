"""Lookahead decoding: the combined mask, the window's independence from the verified logits, exactness through the
loop (greedy token-identical, sampling distribution), the cache after each round, and that the pool pays on
repetitive text and the sizing falls back to plain decoding where it does not.

References are independent: hand-written masks, forwards without the window, plain ``generate``, per-row Python
versions of the vectorised pool, lookup and merge.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import hf_kvspec
from hf_kvspec.speculative.drafters.lookahead import LookaheadAssistant
from hf_kvspec.speculative.drafters.lookahead_sizing import PLAIN, AutoLookahead, Shape, lookahead_menu
from hf_kvspec.speculative.drafters.lookahead_window import (
    JacobiWindow,
    combined_mask,
    verify_block,
    window_mask,
    window_offsets,
)
from hf_kvspec.speculative.drafters.ngram import lookup_continuation
from hf_kvspec.speculative.drafters.ngram_pool import NgramPool, context_continuation, merge_candidates
from hf_kvspec.speculative.tree import CandidateTree
from tests.speculative.markov import MarkovConfig, MarkovLM
from tests.speculative.test_sampling import _joint_tv, _noise_floor, exact_joint, speculative_samples
from tests.tiny_models import left_padded_batch, tiny_model

MAX_NEW = 30
PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7], [10, 11, 12], [13, 14, 15, 16, 17, 18, 19]]


def _rows(text: str) -> torch.Tensor:
    return torch.tensor([[int(c) for c in line.split()] for line in text.strip().splitlines()], dtype=torch.bool)


# ---------------------------------------------------------------------------------------------- masks
def test_window_mask_w2_n4_equals_hand_written():
    """Three levels a, b, c of two columns: (l, j) sees level 0 up to j and its own column up to level l."""
    want = _rows("""
        1 0 0 0 0 0
        1 1 0 0 0 0
        1 0 1 0 0 0
        1 1 0 1 0 0
        1 0 1 0 1 0
        1 1 0 1 0 1""")  # rows/cols a0 a1 b0 b1 c0 c1
    assert torch.equal(window_mask(3, 2), want)
    assert window_offsets(3, 2).tolist() == [1, 2, 2, 3, 3, 4]


def test_combined_mask_w3_n3_equals_hand_written():
    """The docs' worked example: prefix s0 (padding) s1, root r, tree x -> {y, z}, window a (level 0), b."""
    tree = CandidateTree.build(torch.tensor([[7, 8, 9]]), torch.tensor([-1, 0, 0]))
    block = verify_block(tree.attention_mask(torch.tensor([[0, 1]]), torch.float32), 1, 2, 4)
    want = _rows("""
        0 1 1 0 0 0 0 0 0 0 0 0
        0 1 1 1 0 0 0 0 0 0 0 0
        0 1 1 1 1 0 0 0 0 0 0 0
        0 1 1 1 0 1 0 0 0 0 0 0
        0 1 1 0 0 0 1 0 0 0 0 0
        0 1 1 0 0 0 1 1 0 0 0 0
        0 1 1 0 0 0 1 1 1 0 0 0
        0 1 1 0 0 0 1 0 0 1 0 0
        0 1 1 0 0 0 1 1 0 0 1 0
        0 1 1 0 0 0 1 1 1 0 0 1""")  # keys s0 s1 | r x y z | a0 a1 a2 b0 b1 b2
    assert torch.equal(combined_mask(block, window_mask(2, 3))[0, 0], want)


def test_verify_block_of_a_chain_equals_the_chain_tree_mask():
    """2D mask (padding, a hole) and no mask give the causal block a chain's tree mask gives."""
    prefix = torch.tensor([[0, 1, 1, 0], [1, 1, 1, 1]])
    chain = CandidateTree.build(torch.tensor([[4, 5], [6, 7]]), torch.tensor([-1, 0]))
    want = chain.attention_mask(prefix)[:, 0]
    two_d = torch.cat([prefix, torch.ones(2, 3, dtype=torch.long)], dim=1)
    assert torch.equal(verify_block(two_d, 2, 4, 3), want)
    assert torch.equal(verify_block(None, 2, 4, 3), chain.attention_mask(torch.ones_like(prefix))[:, 0])


# ---------------------------------------------------------------------------------------------- one forward
def _prefilled(model, ids, mask):
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, cache=cache, use_cache=True)
    return cache


def _full_window(rows: int, width: int, ngram: int, seed: int = 0) -> JacobiWindow:
    gen = torch.Generator().manual_seed(seed)
    window = JacobiWindow(torch.randint(3, 90, (rows, width), generator=gen), ngram)
    while window.depth < ngram - 1:
        window.advance(torch.randint(3, 90, (rows, width), generator=gen), width)
    return window


def test_window_leaves_verified_logits_and_cache_as_without_it():
    """Root + tree with and without the lookahead branch: same logits at the verified columns and the same cache
    afterwards (the branch's columns are cropped). fp32, extra masked keys reorder sums: atol 1e-5."""
    model = tiny_model("llama", seed=0)
    ids, mask = left_padded_batch([[5, 6, 7, 8], [9, 10]])
    tree = CandidateTree.build(torch.tensor([[11, 12, 13], [14, 15, 16]]), torch.tensor([[-1, 0, 0], [-1, -1, 1]]))
    root = torch.tensor([[20], [21]])
    inputs = dict(input_ids=torch.cat([root, tree.tokens], 1), attention_mask=tree.attention_mask(mask, torch.float32),
                  position_ids=tree.position_ids(torch.tensor([4, 2])), logits_to_keep=4)
    plain_cache, cache = _prefilled(model, ids, mask), _prefilled(model, ids, mask)
    with torch.no_grad():
        want = model(**inputs, cache=plain_cache, use_cache=True).logits
        assistant = LookaheadAssistant(window=3, ngram=3, guesses=2, num_draft_tokens=8)
        assistant.jacobi = _full_window(2, 3, 3)
        assistant.pool = NgramPool(2, 16, 3)
        got, _ = assistant.verify_forward(model, inputs, cache, None)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for layer, plain in zip(cache.layers, plain_cache.layers):
        torch.testing.assert_close(layer.keys, plain.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(layer.values, plain.values, atol=1e-5, rtol=1e-5)
    assert int(assistant.pool.sizes.min()) == 3  # the full window yielded one n-gram per column


def test_new_level_is_each_columns_plain_next_token():
    """The reference for the window: column j's new token is the argmax of a plain causal forward over the
    committed tokens, the root, level 0's columns 0..j and column j's upper levels (one row, no padding)."""
    model = tiny_model("llama", seed=0)
    prompt, root = [5, 6, 7, 8, 9], 20
    window = _full_window(1, 4, 4, seed=1)
    levels = window.levels.clone()  # [1, 3, 4]
    cache = _prefilled(model, torch.tensor([prompt]), None)
    assistant = LookaheadAssistant(window=4, ngram=4, guesses=2, num_draft_tokens=8)
    assistant.jacobi, assistant.pool = window, NgramPool(1, 16, 4)
    inputs = dict(input_ids=torch.tensor([[root]]), attention_mask=None, position_ids=torch.tensor([[5]]),
                  logits_to_keep=1)
    with torch.no_grad():
        assistant.verify_forward(model, inputs, cache, None)
        for j in range(4):
            sequence = [*prompt, root, *levels[0, 0, : j + 1].tolist(), *levels[0, 1:, j].tolist()]
            want = int(model(input_ids=torch.tensor([sequence])).logits[0, -1].argmax())
            assert int(window.levels[0, -1, j]) == want


# ---------------------------------------------------------------------------------------------- the loop
def _cache(kind: str, model):
    if kind == "paged":
        return hf_kvspec.PagedCache(model.config, block_size=4, num_blocks=96)
    return None if kind == "generate" else DynamicCache(config=model.config)


def _generate(model, ids, mask, assistant=None, cache=None, **kw):
    extra = {} if assistant is None else dict(custom_generate=hf_kvspec.speculative_generate, assistant=assistant,
                                              return_dict_in_generate=True, cache=cache)
    return model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=MAX_NEW, pad_token_id=0,
                          **extra, **kw)


@pytest.mark.parametrize("sizing", [12, "auto"])
@pytest.mark.parametrize("cache_kind", ["generate", "dynamic", "paged"])
@pytest.mark.parametrize("bs", [1, 3])
def test_greedy_matches_plain(bs, cache_kind, sizing):
    model = tiny_model("llama", seed=0)
    ids, mask = left_padded_batch(PROMPTS[:bs])
    expected = _generate(model, ids, mask)
    assistant = LookaheadAssistant(window=4, ngram=3, guesses=3, num_draft_tokens=sizing)
    out = _generate(model, ids, mask, assistant, _cache(cache_kind, model))
    assert torch.equal(out.sequences, expected)
    assert sum(out.acceptance.accepted) > 0  # candidates were verified and some kept


def test_greedy_matches_plain_when_rows_leave():
    """A row that stops early (its own EOS) leaves the batch: windows and pools follow the remaining rows."""
    model = tiny_model("llama", seed=0)
    ids, mask = left_padded_batch(PROMPTS)
    first = _generate(model, ids, mask)
    eos = int(first[1, ids.shape[1] + 5])  # a token row 1 emits early
    expected = _generate(model, ids, mask, eos_token_id=eos)
    out = _generate(model, ids, mask, LookaheadAssistant(window=4, ngram=3, guesses=3, num_draft_tokens=12),
                    eos_token_id=eos)
    assert torch.equal(out.sequences, expected)
    assert out.acceptance.rows_dropped >= 1


class _Checked(LookaheadAssistant):
    """Checks after every round that each row's real cache columns equal a plain forward's over its tokens."""

    def __init__(self, model, cache, **kw):
        super().__init__(**kw)
        self.model, self.cache, self.checked = model, cache, 0

    def propose(self, ctx):
        self.buffer = ctx.buffer
        return super().propose(ctx)

    def observe(self, outcome) -> None:
        super().observe(outcome)
        width, buffer = outcome.kept_width, self.buffer
        assert self.cache.get_seq_length() == width
        for row in range(buffer.tokens.shape[0]):
            real = buffer.mask[row, :width].bool()
            plain = _prefilled(self.model, buffer.tokens[row, :width][real][None], None)
            for got, want in zip(self.cache.layers, plain.layers):
                # fp32: the combined forward adds masked keys and rows, so sums are reordered (atol 1e-5)
                torch.testing.assert_close(got.keys[row][:, real], want.keys[0], atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(got.values[row][:, real], want.values[0], atol=1e-5, rtol=1e-5)
        self.checked += 1


def test_cache_after_each_round_equals_plain_forward():
    model = tiny_model("llama", seed=0)
    ids, mask = left_padded_batch(PROMPTS)
    cache = DynamicCache(config=model.config)
    assistant = _Checked(model, cache, window=4, ngram=3, guesses=3, num_draft_tokens=12)
    out = _generate(model, ids, mask, assistant, cache)
    assert torch.equal(out.sequences, _generate(model, ids, mask))
    assert assistant.checked >= 5 and bool((assistant.buffer.mask == 0).any())  # rounds with holes


class _IndexedMarkov(MarkovLM):
    """The bigram test model, also taking ``logits_to_keep`` as a tensor of positions (as transformers' models)."""

    def forward(self, input_ids, logits_to_keep=0, **kwargs):
        out = super().forward(input_ids, **kwargs)
        if isinstance(logits_to_keep, torch.Tensor):
            out.logits = out.logits[:, logits_to_keep]
        elif logits_to_keep:
            out.logits = out.logits[:, -logits_to_keep:]
        return out


def test_sampling_matches_plain_sampling():
    """The joint of the second and third tokens (house test, ``test_sampling.py``: TV < 0.01 at 100k rows, noise
    floor < 0.008) with trees merged from context and pool candidates, per-row node counts (filler nodes)."""
    gen = torch.Generator().manual_seed(0)
    target = _IndexedMarkov(MarkovConfig(vocab_size=8, sharpness=1.5, pad_token_id=0)).eval()
    with torch.no_grad():
        target.lm_head.weight.copy_(torch.randn(8, 8, generator=gen).T * 1.5)
    sampling = dict(temperature=0.9, top_k=0)
    exact = exact_joint(target, **sampling)
    assert _noise_floor(exact) < 0.008
    torch.manual_seed(0)
    assistant = LookaheadAssistant(window=2, ngram=3, guesses=2, num_draft_tokens=6, pool_size=6)
    samples, stats = speculative_samples(target, assistant, max_new_tokens=5, **sampling)
    assert _joint_tv(samples, exact) < 0.01
    assert 0.05 < stats.mean_acceptance < 0.95


# ---------------------------------------------------------------------------------------------- does it pay
def test_window_pool_pays_on_repetitive_text():
    """The window alone (no context lookup) finds the n-grams of a looping continuation: tau > 1.5."""
    model = tiny_model("llama", seed=0)
    ids, mask = left_padded_batch([[5, 6, 7, 8, 9] * 3])
    assistant = LookaheadAssistant(window=5, ngram=4, guesses=4, prompt_ngrams=False, num_draft_tokens=12)
    out = _generate(model, ids, mask, assistant, max_length=ids.shape[1] + 60)
    assert torch.equal(out.sequences, _generate(model, ids, mask, max_length=ids.shape[1] + 60))
    assert out.acceptance.tokens_per_target_forward > 1.5


def _drive(sizing: AutoLookahead, tokens_of, seconds_of, rounds: int) -> list[Shape]:
    chosen = []
    for _ in range(rounds):
        shape = sizing.choose()
        fed = sizing.fed_tokens(shape)
        sizing.update(shape, fed, sizing.max_nodes[shape], tokens_of(shape), seconds_of(fed), 0.0)
        chosen.append(shape)
    return chosen


def _sizing() -> AutoLookahead:
    menu = lookahead_menu(6, 4, True)
    return AutoLookahead(menu, 4, {s: s.guesses * 3 + 3 * s.context for s in menu})


def test_sizing_falls_back_to_plain_on_random_text():
    """Nothing accepted and every fed token costing 10% of a step: after the warm-up, plain decoding nearly always
    (a probe every 16 rounds); the extra cost is the warm-up and the probes."""
    chosen = _drive(_sizing(), lambda s: 1.0, lambda fed: 1.0 + 0.1 * (fed - 1), 200)
    late = chosen[50:]
    assert late.count(PLAIN) / len(late) > 0.85


def test_sizing_warms_up_again_in_each_call_and_keeps_its_costs():
    sizing = _sizing()
    sizing.start_call(1)
    _drive(sizing, lambda s: 1.0, lambda fed: 1.0 + 0.1 * (fed - 1), 40)
    costs = dict(sizing.cost)
    sizing.start_call(1)
    assert sizing.cost == costs and sizing.choose() == sizing.largest  # same rows: kept, warm-up again
    sizing.start_call(2)
    assert sizing.cost == {}  # other rows: verify cost differs, start over


def test_sizing_keeps_the_largest_shape_where_tokens_are_cheap():
    """High acceptance for the widest window and a flat forward cost (a GPU): the largest shape stays."""
    sizing = _sizing()
    chosen = _drive(sizing, lambda s: 1.0 + s.window * 0.3 + s.guesses * 0.2, lambda fed: 1.0, 100)
    assert chosen[-50:].count(sizing.largest) > 40


# ---------------------------------------------------------------------------------------------- pool and merge
def test_pool_against_a_dictionary():
    """Random adds into a pool of 5: the held n-grams and the lookups equal a dict of n-gram -> last stamp with the
    oldest evicted."""
    gen = torch.Generator().manual_seed(0)
    pool = NgramPool(2, 5, 3)
    reference = [{}, {}]
    clock = 0
    for _ in range(40):
        grams = torch.randint(0, 3, (2, 3, 3), generator=gen)
        valid = torch.rand(2, 3, generator=gen) < 0.8
        pool.add(grams, valid)
        for row in range(2):
            for m in range(3):
                if valid[row, m]:
                    reference[row][tuple(grams[row, m].tolist())] = clock + m
                    while len(reference[row]) > 5:
                        del reference[row][min(reference[row], key=reference[row].get)]
        clock += 3
        for row in range(2):
            held = {tuple(g) for g, s in zip(pool.grams[row].tolist(), pool.stamp[row].tolist()) if s >= 0}
            assert held == set(reference[row])
        keys = torch.randint(0, 3, (2,), generator=gen)
        tails = pool.lookup(keys, 2)
        for row in range(2):
            ranked = sorted((s, g) for g, s in reference[row].items() if g[0] == int(keys[row]))[::-1][:2]
            want = [list(g[1:]) for _, g in ranked] + [[-1, -1]] * (2 - len(ranked))
            assert tails[row].tolist() == want


def test_context_continuation_equals_lookup_per_row():
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 7, (6, 14), generator=gen)
    first = torch.tensor([0, 2, 4, 0, 9, 11])
    lengths = torch.tensor([14, 12, 9, 5, 13, 13])
    ids[torch.arange(14)[None] < first[:, None]] = 0
    got = context_continuation(ids, lengths, first, 3, 4)
    for row in range(6):
        want = lookup_continuation(ids[row, first[row]: lengths[row]], 3, 1, 4).tolist()
        assert got[row].tolist() == want + [-1] * (4 - len(want))


def _trie(candidates: list[list[int]]) -> tuple[list[int], list[int]]:
    """Python reference: nodes keyed by their path, numbered by first candidate then depth."""
    paths = {}
    for c, cand in enumerate(candidates):
        for d in range(len(cand)):
            if cand[d] < 0:
                break
            paths.setdefault(tuple(cand[: d + 1]), (c, d))
    order = sorted(paths, key=paths.get)
    index = {p: n for n, p in enumerate(order)}
    return [p[-1] for p in order], [index[p[:-1]] if len(p) > 1 else -1 for p in order]


def test_merge_candidates_equals_a_trie():
    candidates = torch.tensor([[[4, 5, 6], [4, 5, 7], [8, -1, 9], [4, 9, -1]],
                               [[3, 3, 3], [-1, 1, 1], [3, 3, 3], [2, 2, -1]]])
    tokens, parents = merge_candidates(candidates, torch.tensor([0, 1]))
    for row in range(2):
        want_tokens, want_parents = _trie(candidates[row].tolist())
        count = len(want_tokens)
        assert tokens[row, :count].tolist() == want_tokens and parents[row, :count].tolist() == want_parents
        assert tokens[row, count:].tolist() == [row] * (tokens.shape[1] - count)  # filler children of the root
        assert parents[row, count:].tolist() == [-1] * (tokens.shape[1] - count)
    capped, capped_parents = merge_candidates(candidates, torch.tensor([0, 1]), max_nodes=3)
    assert capped.tolist() == tokens[:, :3].tolist() and capped_parents.tolist() == parents[:, :3].tolist()


def test_options_are_checked():
    with pytest.raises(ValueError, match="ngram must be an int >= 2"):
        LookaheadAssistant(ngram=1)
    with pytest.raises(ValueError, match="window must be an int >= 1"):
        LookaheadAssistant(window=0)
    with pytest.raises(ValueError, match="num_draft_tokens"):
        LookaheadAssistant(num_draft_tokens="many")


def test_make_assistant_spec():
    from hf_kvspec.cli import _speculative_kwargs, build_parser
    from hf_kvspec.speculative.assistants import check_spec, make_assistant

    target = tiny_model("llama", seed=0)
    built = make_assistant("lookahead:4:3:2", target, "auto")
    assert (built.window, built.ngram, built.guesses, built.sizing is not None) == (4, 3, 2, True)
    default = make_assistant("lookahead", target, 6)
    assert (default.window, default.ngram, default.guesses, default.sizing) == (5, 4, 5, None)
    assert default.num_draft_tokens == 6
    for bad in ("lookahead:0", "lookahead:4:1", "lookahead:4:3:2:1", "lookahead:x"):
        with pytest.raises(ValueError, match="lookahead"):
            check_spec(bad)
    args = build_parser().parse_args(["generate", "hi", "--assistant", "lookahead:3"])
    assert _speculative_kwargs(args, target)["assistant"].sizing is not None  # the CLI default is auto


@pytest.mark.slow
def test_bundled_model_code_edit(bundled):
    """SmolLM2-135M asked to return edited code (the answer copies the prompt): token-identical to plain greedy at
    bs=2 (left padding), and tau > 1.5 at bs=1 (measured 2.2 over 48 tokens; NgramAssistant's is the same)."""
    model, tokenizer = bundled
    code = "def mean(values):\n    total = 0\n    for v in values:\n        total = total + v\n    return total / len(values)\n"
    prompts = [f"Add type hints to this Python function and return the full code.\n\n{code}", "Name three colors."]
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                           tokenize=False) for p in prompts]
    tokenizer.padding_side = "left"
    for rows in (2, 1):
        inputs = tokenizer(texts[:rows], return_tensors="pt", padding=True, add_special_tokens=False)
        expected = model.generate(**inputs, do_sample=False, max_new_tokens=48)
        out = model.generate(**inputs, do_sample=False, max_new_tokens=48,
                             custom_generate=hf_kvspec.speculative_generate,
                             assistant=LookaheadAssistant(num_draft_tokens=16), return_dict_in_generate=True)
        assert torch.equal(out.sequences, expected)
    assert out.acceptance.tokens_per_target_forward > 1.5
