"""The suffix pool inside the engine: no draft proposed for one tenant contains text seen only in another tenant's
requests (checked on the proposals themselves, with a shared pool as the negative control), later requests of a
tenant draft from earlier ones, the mixed drafter uses both sources and stays exact, telemetry and /metrics show
the pool, and bad mixes are refused by name."""

from __future__ import annotations

import json

import pytest

from hf_kvspec.serving.engine import Engine
from hf_kvspec.serving.server_metrics import ServerMetrics
from hf_kvspec.serving.suffix_drafting import SuffixDrafters
from hf_kvspec.speculative.drafters.draft_model import DraftModelAssistant
from hf_kvspec.speculative.drafters.suffix import SuffixAssistant
from hf_kvspec.speculative.suffix_pool import SuffixPool
from tests.tiny_models import tiny_model

from .helpers import assert_pool_full, greedy_reference, random_prompts, run_to_end

VOCAB = 12


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


def _spy_on_proposals(monkeypatch) -> list:
    """Record every (salt, path of drafted tokens) the engine's suffix drafter proposes."""
    seen = []
    original = SuffixDrafters.propose

    def propose(self, request, count):
        proposal = original(self, request, count)
        draft = self.last[request.request_id]
        for node in range(len(draft.tokens)):
            path, at = [], node
            while at >= 0:
                path.insert(0, draft.tokens[at])
                at = draft.parents[at]
            seen.append((request.salt, request.tokens[-1:] + path))
        return proposal

    monkeypatch.setattr(SuffixDrafters, "propose", propose)
    return seen


def _contains(texts: list[list[int]], path: list[int]) -> bool:
    return any(text[i: i + len(path)] == path for text in texts for i in range(len(text) - len(path) + 1))


def _run_tenants(model, pool: SuffixPool, salts: dict[str, str | None]) -> dict[str, list[list[int]]]:
    """Tenants' requests in turns (each tenant's prompts share n-grams with the others'), greedy; returns each
    tenant's texts (prompt + output)."""
    engine = Engine(model, draft_lengths="fixed", kv_budget=512, block_size=4, max_tokens_per_round=64, max_running=6,
                    assistant=SuffixAssistant(pool=pool, min_prob=0.05))
    texts = {name: [] for name in salts}
    for turn in range(3):
        ids = {}
        for index, (name, salt) in enumerate(salts.items()):
            for prompt in random_prompts([18, 24], seed=10 * turn + index, vocab=VOCAB):
                ids[engine.add_request(prompt, max_new_tokens=16, salt=salt)] = (name, prompt)
        run_to_end(engine)
        for request_id, (name, prompt) in ids.items():
            texts[name].append(prompt + engine.get_output(request_id).output_ids)
    assert_pool_full(engine)
    return texts


def test_no_draft_for_one_tenant_holds_text_seen_only_in_anothers(llama, monkeypatch):
    seen = _spy_on_proposals(monkeypatch)
    texts = _run_tenants(llama, SuffixPool(), {"A": "tenant-a", "B": "tenant-b", "U": None})
    by_salt = {"tenant-a": "A", "tenant-b": "B", None: "U"}
    assert len(seen) > 50
    for salt, path in seen:  # the context's last token and the drafted path occur in the tenant's own text
        assert _contains(texts[by_salt[salt]], path), (salt, path)
    # negative control: one shared tenant for everyone proposes text the requesting tenant never saw
    seen.clear()
    texts = _run_tenants(llama, SuffixPool(share_unsalted=True), {"A": None, "B": None})
    shared = [(salt, path) for salt, path in seen if not _contains(texts["B"], path) or not _contains(texts["A"], path)]
    assert shared, "the control never drafted across requests: the isolation check above could not fail"


def test_later_requests_of_a_tenant_draft_from_earlier_ones(llama):
    pool = SuffixPool()
    engine = Engine(llama, draft_lengths="fixed", kv_budget=256, block_size=4, max_tokens_per_round=64, max_running=4,
                    assistant=SuffixAssistant(pool=pool, min_prob=0.05))
    prompt = random_prompts([20], seed=7, vocab=96)[0]  # few repeats within itself
    first = engine.add_request(prompt, max_new_tokens=24, salt="t")
    run_to_end(engine)
    first_out = engine.get_output(first)
    again = engine.add_request(prompt, max_new_tokens=24, salt="t")
    other = engine.add_request(prompt, max_new_tokens=24, salt="u")
    run_to_end(engine)
    again_out, other_out = engine.get_output(again), engine.get_output(other)
    assert again_out.output_ids == other_out.output_ids == first_out.output_ids == greedy_reference(llama, prompt, 24)
    assert again_out.metrics.tau > 4 > other_out.metrics.tau  # tenant t drafts its earlier answer, u cannot
    telemetry = engine.telemetry()
    assert telemetry["suffix_pool"]["sequences"] == 3 and telemetry["suffix_pool"]["hits"] > 0
    metrics = ServerMetrics().render(telemetry, draining=False)
    assert f"kvspec_suffix_pool_bytes {pool.nbytes}" in metrics
    assert "kvspec_suffix_pool_lookups_total" in metrics and "kvspec_suffix_pool_hit_rate" in metrics


def test_the_mixed_drafter_uses_both_sources_and_stays_exact(llama):
    """The suffix pool drafts the repeated request, the draft model (the target itself: always right) the new
    ones; every output equals plain greedy."""
    prompts = random_prompts([9, 14, 6, 11], seed=2, vocab=VOCAB)
    engine = Engine(llama, draft_lengths="fixed", kv_budget=256, block_size=4, max_tokens_per_round=48, max_running=4,
                    assistant=[SuffixAssistant(pool=SuffixPool(share_unsalted=True), min_prob=0.05),
                               DraftModelAssistant(llama, num_draft_tokens=3)])
    for batch in (prompts, prompts[:2] + random_prompts([7], seed=9, vocab=VOCAB)):
        ids = [engine.add_request(p, max_new_tokens=20) for p in batch]
        run_to_end(engine)
        for request_id, prompt in zip(ids, batch):
            assert engine.get_output(request_id).output_ids == greedy_reference(llama, prompt, 20)
    drafted_by = engine.telemetry()["drafted_by"]
    assert drafted_by["suffix"] > 0 and drafted_by["model"] > 0, drafted_by
    assert_pool_full(engine)


def test_the_mixed_drafter_chooses_its_source_before_the_plan(llama):
    """Under the goodput choice the source is chosen before the plan: a request whose pool draft wins gives the
    budget the pool's gains (its lookup is sunk), one whose model drafts promise more gives none (the budget then
    uses its acceptance); outputs stay greedy's."""
    prompt = random_prompts([12], seed=4, vocab=VOCAB)[0]
    engine = Engine(llama, kv_budget=256, block_size=4, max_tokens_per_round=48, max_running=2,
                    assistant=[SuffixAssistant(pool=SuffixPool(share_unsalted=True), min_prob=0.05),
                               DraftModelAssistant(llama, num_draft_tokens=3)])
    first = engine.add_request(prompt, max_new_tokens=20)
    run_to_end(engine)
    again = engine.add_request(prompt, max_new_tokens=20)
    engine.step()  # prefill: the request starts decoding, its pool and model drafter states begin
    request = engine.scheduler.running[0]
    mixed = engine.drafts.drafters
    mixed.model_alpha.requests[again] = [0.0, 100.0]  # the model's drafts are never accepted: the pool's win
    gains = mixed.expected_gains(request, 4, 1)
    assert gains and all(0 < g <= 1 for g in gains) and mixed.planned[again] == "suffix"
    mixed.model_alpha.requests[again], mixed.suffix.ratio.requests[again] = [100.0, 100.0], [0.0, 100.0]
    mixed.model_seconds = 0.0  # a free model accepted every time against a pool that never is
    assert mixed.expected_gains(request, 4, 1) is None and mixed.planned[again] == "model"
    mixed.model_seconds = engine.drafts.step  # a model call as long as the round's forward: it delays every row,
    assert mixed.expected_gains(request, 4, 1) is None  # which pays for one row (5 tokens in 2 steps, not 1 in 1)
    assert mixed.expected_gains(request, 4, 16) is not None  # but not for sixteen (20 in 2 steps, not 16 in 1)
    run_to_end(engine)
    assert engine.get_output(again).output_ids == engine.get_output(first).output_ids == \
        greedy_reference(llama, prompt, 20)
    assert_pool_full(engine)


def test_auto_is_the_pool_alone_where_the_bundled_head_does_not_fit(llama):
    engine = Engine(llama, kv_budget=64, block_size=4, assistant="auto")
    assert isinstance(engine.drafts.drafters, SuffixDrafters)


@pytest.mark.parametrize("assistant, message", [
    (["ngram", "suffix", "suffix"], "two assistants are the suffix pool and one model drafter"),
    (["ngram", "eagle"], "two assistants are the suffix pool and one model drafter"),
    ("suffix+self-int8", "self-int8 drafts for all requests at once"),
])
def test_bad_mixes_are_refused_by_name(llama, assistant, message):
    with pytest.raises(ValueError, match=message):
        Engine(llama, kv_budget=64, block_size=4, assistant=assistant)


def test_the_servers_cache_salt_names_the_tenant(llama):
    """Over HTTP: ``cache_salt`` reaches the engine, so a tenant's repeated request drafts its earlier answer, and
    another tenant's does not; an empty salt is a 400 naming the field."""
    from .server_harness import RunningServer, tiny_tokenizer

    engine = Engine(llama, tiny_tokenizer(), draft_lengths="fixed", kv_budget=256, block_size=4,
                    max_tokens_per_round=64, max_running=4, assistant=SuffixAssistant(pool=SuffixPool(), min_prob=0.05))
    prompt = "t7 t19 t33 t41 t8 t60 t12 t77 t20 t51 t64"
    with RunningServer(engine) as server:
        client = server.client()

        def tau(salt):
            response = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0,
                                                 extra_body={"cache_salt": salt})
            return response.kvspec["choices"][0]["tau"], response.choices[0].text

        first, text = tau("alpha")
        again, again_text = tau("alpha")
        other, other_text = tau("beta")
        assert text == again_text == other_text
        assert again > 4 > other, (first, again, other)
        status, _, body = server.raw("POST", "/v1/completions",
                                     json.dumps({"model": "tiny", "prompt": prompt, "cache_salt": ""}))
        assert status == 400 and b"cache_salt" in body
