"""Shared helpers of the serving tests: plain-generate references and the pool check."""

from __future__ import annotations

import torch

from hf_kvspec.serving.engine import Engine


def random_prompts(lengths, seed: int = 0, vocab: int = 96) -> list[list[int]]:
    """Prompts of the given lengths; ids from 3 on (0 pad, 1 bos and 2 eos of the tiny configs are left out)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


def greedy_reference(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """The oracle: ``model.generate(do_sample=False)`` on this prompt alone (stops at the model's EOS too)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new_tokens)
    return out[0, len(prompt):].tolist()


def run_to_end(engine: Engine, max_rounds: int = 10_000) -> None:
    for _ in range(max_rounds):
        if not engine.has_unfinished():
            return
        engine.step()
    raise AssertionError("the engine did not drain")


def assert_pool_full(engine: Engine) -> None:
    """Every block is back in the free queue and no sequence holds a row (cached blocks count as free)."""
    cache = engine.cache
    assert cache.seq_ids == [] and cache.tables.num_rows == 0
    assert cache.num_free_blocks() == cache.num_total_blocks()
    assert all(cache.pool.ref_count(b) == 0 for b in range(cache.num_total_blocks()))


def run_with_arrivals(engine, prompts, max_new: list[int], arrivals: dict[int, list[int]]) -> list[int]:
    """Step ``engine`` until every request is done, adding prompt ``i`` before round ``r`` for each ``i`` in
    ``arrivals[r]``; returns the request ids in arrival order."""
    ids = []
    for round_index in range(200):
        for i in arrivals.get(round_index, []):
            ids.append(engine.add_request(prompts[i], max_new_tokens=max_new[i]))
        if round_index > max(arrivals) and not engine.has_unfinished():
            break
        engine.step()
    return ids
