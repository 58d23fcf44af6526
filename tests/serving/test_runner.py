"""The packed forward against plain forwards of each sequence alone, including the speculation seam: draft
tokens with tree positions and a tree mask in the same packed run, then a per-sequence rollback."""

from __future__ import annotations

import pytest
import torch

from hf_kvspec.cache.ragged import RaggedPagedCache
from hf_kvspec.serving.attention import register_ragged_attention
from hf_kvspec.serving.runner import ForwardRow, ForwardRunner
from tests.tiny_models import tiny_model

from .helpers import random_prompts

# packed vs alone: different matmul shapes reassociate fp32 sums (~1e-6 on these logits); 1e-4 leaves margin
TOL = dict(rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def llama():
    register_ragged_attention()
    return tiny_model("llama")


def plain_last_logits(model, ids: list[int]) -> torch.Tensor:  # [V]
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1]


def forward(runner, cache, rows):
    for row in rows:
        cache.reserve(row.seq_id, row.start + len(row.token_ids))
    logits = runner.forward(rows)
    cache.end_forward(ok=True)
    return logits


def test_tree_verify_and_rollback_match_plain_forwards(llama):
    cache = RaggedPagedCache(llama.config, num_blocks=32, block_size=4)
    runner = ForwardRunner(llama, cache)
    prompt, other = random_prompts([9, 6], seed=40)
    for seq_id, ids in ((0, prompt), (1, other)):
        cache.add_sequence(seq_id, ids)
    forward(runner, cache, [ForwardRow(0, prompt, 0), ForwardRow(1, other, 0)])

    # seq 0 verifies a tree: a -> (b, c) at depths 0, 1, 1, next to a plain decode row of seq 1
    a, b, c, d = 7, 11, 13, 17
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    L = len(prompt)
    logits = forward(runner, cache, [
        ForwardRow(0, [a, b, c], L, positions=[L, L + 1, L + 1], new_token_mask=tree, logits_at=(0, 1, 2)),
        ForwardRow(1, [d], len(other), logits_at=(0,)),
    ])
    expected = [[*prompt, a], [*prompt, a, b], [*prompt, a, c], [*other, d]]
    for k, ids in enumerate(expected):
        torch.testing.assert_close(logits[k], plain_last_logits(llama, ids), **TOL)

    # accept a and c: keep a, roll b and c back, re-feed c on the path (chain), then continue from it
    cache.truncate(0, L + 1)
    assert cache.length(0) == L + 1
    logits = forward(runner, cache, [ForwardRow(0, [c, b], L + 1, logits_at=(0, 1))])
    torch.testing.assert_close(logits[0], plain_last_logits(llama, [*prompt, a, c]), **TOL)
    torch.testing.assert_close(logits[1], plain_last_logits(llama, [*prompt, a, c, b]), **TOL)
    cache.release_all()
    assert cache.num_free_blocks() == cache.num_total_blocks()


def test_a_failed_forward_leaves_no_reservation(llama):
    cache = RaggedPagedCache(llama.config, num_blocks=8, block_size=4)
    runner = ForwardRunner(llama, cache)
    cache.add_sequence(0, [5, 6, 7])
    cache.reserve(0, 3)
    assert cache.num_free_blocks() == 7
    with pytest.raises(ValueError, match="reserve"):
        runner.forward([ForwardRow(0, [5, 6, 7, 8, 9], 0)])  # more tokens than reserved: refused up front
    cache.end_forward(ok=False)
    assert cache.num_free_blocks() == 8 and cache.length(0) == 0


def test_rollback_into_a_shared_prefix_block_copies_it(llama):
    """Sequence 1 attaches sequence 0's cached blocks, rolls back into one of them and writes other tokens there:
    copy-on-write keeps sequence 0's K/V intact."""
    cache = RaggedPagedCache(llama.config, num_blocks=16, block_size=4)
    runner = ForwardRunner(llama, cache)
    prompt = random_prompts([12], seed=41)[0]
    cache.add_sequence(0, prompt)
    forward(runner, cache, [ForwardRow(0, prompt, 0)])
    assert cache.add_sequence(1, [*prompt, 9]) == 12  # all three blocks served from the cache
    shared = cache.tables.table(cache._row_of[1])[1]
    cache.truncate(1, 6)  # into the second shared block
    used_before = cache.num_total_blocks() - cache.num_free_blocks()
    new = [21, 22, 23]
    logits = forward(runner, cache, [ForwardRow(1, new, 6, logits_at=(2,)), ForwardRow(0, [5], 12, logits_at=(0,))])
    assert cache.tables.table(cache._row_of[1])[1] != shared  # copied, not written in place
    # + the copy of the shared block, + seq 1's block for position 8, + seq 0's block for position 12
    assert cache.num_total_blocks() - cache.num_free_blocks() == used_before + 3
    torch.testing.assert_close(logits[0], plain_last_logits(llama, prompt[:6] + new), **TOL)
    torch.testing.assert_close(logits[1], plain_last_logits(llama, [*prompt, 5]), **TOL)


def mixed_rounds(runner, cache, prompts):
    """Prefill chunks beside decode rows, then decode rounds: the logits of every round, [K, V] each."""
    for seq_id, ids in enumerate(prompts):
        cache.add_sequence(seq_id, ids)
    rounds = [forward(runner, cache, [ForwardRow(0, prompts[0], 0, logits_at=(len(prompts[0]) - 1,))])]
    rounds.append(forward(runner, cache, [ForwardRow(0, [5], len(prompts[0]), logits_at=(0,)),
                                          ForwardRow(1, prompts[1][:7], 0), ForwardRow(2, prompts[2], 0, logits_at=(2,))]))
    for step in range(3):
        rows = [ForwardRow(0, [6 + step], cache.length(0), logits_at=(0,)),
                ForwardRow(2, [9 + step], cache.length(2), logits_at=(0,))]
        if step == 0:
            rows.insert(1, ForwardRow(1, prompts[1][7:], 7, logits_at=(len(prompts[1]) - 8,)))
        else:
            rows.append(ForwardRow(1, [3 + step], cache.length(1), logits_at=(0,)))
        rounds.append(forward(runner, cache, rows))
    return rounds


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gemma2"])  # gemma2: sliding-window layers and soft-capping
@pytest.mark.parametrize("fast_forward", [None, False])
def test_fast_forwards_match_the_reference_path(kind, fast_forward):
    """The fast paths (the fast forward where it applies, else decode kernels + grouped ragged attention) against
    the reference (the model's own forward, stock linears, row-by-row attention)."""
    model = tiny_model(kind)
    register_ragged_attention()
    prompts = random_prompts([11, 19, 3], seed=41)
    runs = []
    for reference in (False, True):
        cache = RaggedPagedCache(model.config, num_blocks=32, block_size=4)
        runner = ForwardRunner(model, cache, reference=reference, fast_forward=None if reference else fast_forward)
        fast = not reference and fast_forward is None and kind != "gemma2"  # gemma2 keeps the model's forward
        assert (runner.fast is not None) == fast
        assert (runner.kernels is None) == (reference or fast)  # the fast forward reads its own packed copies
        runs.append(mixed_rounds(runner, cache, prompts))
    for fast, reference in zip(*runs):
        torch.testing.assert_close(fast, reference, **TOL)


def test_decode_kernels_route_the_forward_and_match_stock(llama):
    """Forced prepacked kernels on every linear (the tiny model's are below the default size floor) give the
    stock forward's logits within fp32 reassociation."""
    from hf_kvspec.kernels.linear import DecodeKernels
    from hf_kvspec.kernels.ops import onednn_available

    prompts = random_prompts([11, 19, 3], seed=42)
    kernel = "onednn" if onednn_available() else "transposed"
    runs = []
    for kernels in (DecodeKernels(llama, route_on_enter=False, min_weight_elements=0, force=kernel), None):
        cache = RaggedPagedCache(llama.config, num_blocks=32, block_size=4)
        runner = ForwardRunner(llama, cache, decode_kernels=False, fast_forward=False)
        runner.kernels = kernels
        with runner.held_across_rounds():
            runs.append(mixed_rounds(runner, cache, prompts))
        if kernels is not None:
            assert kernels.calls[kernel] > 0
    for routed, stock in zip(*runs):
        torch.testing.assert_close(routed, stock, **TOL)


def test_held_across_rounds_keeps_the_switch_and_restores_it(llama):
    from hf_kvspec import _compat

    before = _compat.attn_implementation(llama.config)
    cache = RaggedPagedCache(llama.config, num_blocks=32, block_size=4)
    runner = ForwardRunner(llama, cache, fast_forward=False)  # the model's own forward reads kvspec_ragged
    prompts = random_prompts([5, 8, 3], seed=43)
    with runner.held_across_rounds():
        assert _compat.attn_implementation(llama.config) == "kvspec_ragged"
        held = mixed_rounds(runner, cache, prompts)
        assert _compat.attn_implementation(llama.config) == "kvspec_ragged"
    assert _compat.attn_implementation(llama.config) == before != "kvspec_ragged"
    other = RaggedPagedCache(llama.config, num_blocks=32, block_size=4)
    for got, expected in zip(held, mixed_rounds(ForwardRunner(llama, other, fast_forward=False), other, prompts)):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)  # same kernels and calls: bitwise equal


def test_the_fast_forward_never_switches_the_models_attention(llama, monkeypatch):
    from hf_kvspec import _compat

    before = _compat.attn_implementation(llama.config)
    switches = []
    monkeypatch.setattr(type(llama), "set_attn_implementation", lambda self, name: switches.append(name))
    cache = RaggedPagedCache(llama.config, num_blocks=32, block_size=4)
    runner = ForwardRunner(llama, cache, fast_forward=True)
    with runner.held_across_rounds():
        fast = mixed_rounds(runner, cache, random_prompts([5, 8, 3], seed=43))
    assert switches == [] and _compat.attn_implementation(llama.config) == before
    monkeypatch.undo()
    other = RaggedPagedCache(llama.config, num_blocks=32, block_size=4)
    reference = mixed_rounds(ForwardRunner(llama, other, fast_forward=False), other, random_prompts([5, 8, 3], seed=43))
    for got, expected in zip(fast, reference):
        torch.testing.assert_close(got, expected, **TOL)


def test_self_drafting_drafts_the_int8_copys_chain_on_the_paged_cache_and_keeps_nothing(llama):
    from transformers import DynamicCache

    from hf_kvspec.serving.prompts import make_settings
    from hf_kvspec.serving.request import Request
    from hf_kvspec.serving.self_drafting import SelfDrafters
    from hf_kvspec.speculative.drafters.quantized_self import QuantizedSelfAssistant

    assistant = QuantizedSelfAssistant(llama, "int8")
    cache = RaggedPagedCache(llama.config, num_blocks=32, block_size=4)
    runner, drafters = ForwardRunner(llama, cache), SelfDrafters(assistant, cache)
    prompts = random_prompts([9, 6], seed=41)
    requests = []
    for seq_id, ids in enumerate(prompts):  # the prompt but its last token stored, as for a decode row
        cache.add_sequence(seq_id, ids)
        forward(runner, cache, [ForwardRow(seq_id, ids[:-1], 0)])
        request = Request(seq_id, ids, make_settings(llama.generation_config, max_new_tokens=8))
        request.num_computed = len(ids) - 1
        requests.append(request)
    for request, count in zip(requests, (4, 2)):
        cache.reserve(request.request_id, request.num_computed + 1 + count)
    proposals = drafters.propose_rows(list(zip(requests, (4, 2))))
    for request, count, proposal in zip(requests, (4, 2), proposals):
        assert cache.length(request.request_id) == request.num_computed  # nothing committed
        assert proposal.tokens.shape == (1, count) and proposal.probs is None  # point masses
        reference = DynamicCache(config=llama.config)  # the fp32 target's K/V, then the int8 copy's greedy chain
        with torch.no_grad():
            llama(torch.tensor([request.prompt_ids[:-1]]), cache=reference)
        token, expected = request.prompt_ids[-1], []
        for step in range(count):
            position = request.num_computed + step
            logits, _, reference = assistant.forward(dict(input_ids=torch.tensor([[token]]),
                                                          position_ids=torch.tensor([[position]])), reference)
            token = int(logits[0, -1].argmax())
            expected.append(token)
        assert proposal.tokens[0].tolist() == expected
    cache.end_forward(ok=False)  # the round's reservations go back as after a failed round
    assert cache.num_free_blocks() + sum(-(-r.num_computed // 4) for r in requests) == cache.num_total_blocks()
