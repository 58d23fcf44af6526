"""The decode core's structure: one prefill path for every assistant, a declared protocol, active rows only.

Reference for outputs: plain ``generate(do_sample=False)`` on the same prompt (token-identical).
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

import hf_kvspec
from hf_kvspec.heads.configuration import MedusaConfig
from hf_kvspec.heads.modeling_medusa import MedusaHeads
from hf_kvspec.speculative import loop, preflight
from hf_kvspec.speculative.drafters.base import Assistant, DraftProposal
from tests.tiny_models import tiny_model

MAX_NEW = 12


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama")


def _ids(batch=1, length=9, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(1, 90, (batch, length), generator=generator)


def _plain(model, ids, max_new_tokens=MAX_NEW, **kwargs):
    return model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens,
                          pad_token_id=0, **kwargs)


def _speculative(model, ids, assistant, **kwargs):
    return model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_NEW,
                          pad_token_id=0, custom_generate=hf_kvspec.speculative_generate, assistant=assistant,
                          return_dict_in_generate=True, **kwargs)


def _assistants(target):
    return {
        "ngram": hf_kvspec.NgramAssistant(num_draft_tokens=3),
        "draft_model": hf_kvspec.DraftModelAssistant(target, num_draft_tokens=3),
        "layer_skip": hf_kvspec.LayerSkipAssistant([1], num_draft_tokens=2),
        "early_exit": hf_kvspec.EarlyExitAssistant(1, num_draft_tokens=2, draft_vocab_size=None),
    }


@pytest.mark.parametrize("name", ["ngram", "draft_model", "layer_skip", "early_exit"])
def test_every_call_prefills_once_then_drafts_from_the_first_round(target, name):
    """One prefill forward per call for every assistant, and the first round already drafts (no first-round
    special case: self-drafters used to draft nothing until the prompt was in the cache)."""
    assistant = _assistants(target)[name]
    ids = _ids()
    out = _speculative(target, ids, assistant)
    assert torch.equal(out.sequences, _plain(target, ids))
    stats = out.acceptance
    assert stats.prefill_forwards == 1
    if name != "ngram":  # (the n-gram lookup drafts only when the newest token occurred before)
        assert stats.draft_lengths[0] > 0  # the first round drafted
    # tokens: one from the prefill, the rest from rounds
    assert stats.emitted_tokens == out.sequences.shape[1] - ids.shape[1] - 1


def test_a_cache_that_already_holds_the_whole_prompt_continues_like_plain_generate(target):
    ids = _ids()
    cache = DynamicCache(config=target.config)
    target(ids, cache=cache)
    out = _speculative(target, ids, hf_kvspec.NgramAssistant(num_draft_tokens=3), cache=cache)
    assert torch.equal(out.sequences, _plain(target, ids))


@pytest.mark.parametrize("batch", [1, 3])
def test_a_cache_that_already_holds_the_whole_prompt_continues_with_eagle_too(target, batch):
    """#29 item 5: a caller's cache that holds the whole prompt, with a feature-reading tree assistant, bs 1 and 3."""
    from hf_kvspec.heads.configuration import EagleConfig
    from hf_kvspec.heads.modeling_eagle import EagleHead

    ids = _ids(batch=batch)
    head = EagleHead(EagleConfig.for_base_model(target, "tiny"))
    for make in (lambda: hf_kvspec.NgramAssistant(num_draft_tokens=3),
                 lambda: hf_kvspec.EagleAssistant(head, draft_vocab_size=None)):
        cache = DynamicCache(config=target.config)
        target(ids, cache=cache)
        out = _speculative(target, ids, make(), cache=cache)
        assert torch.equal(out.sequences, _plain(target, ids))


def test_a_cache_that_holds_part_of_the_prompt_prefills_only_the_rest(target):
    ids = _ids(length=10)
    cache = DynamicCache(config=target.config)
    target(ids[:, :6], cache=cache)
    seen = []
    handle = target.model.embed_tokens.register_forward_hook(lambda m, args, out: seen.append(args[0].shape[1]))
    try:
        out = _speculative(target, ids, hf_kvspec.NgramAssistant(num_draft_tokens=3), cache=cache)
    finally:
        handle.remove()
    assert seen[0] == 4  # the prefill fed the 4 columns the cache lacked
    assert torch.equal(out.sequences, _plain(target, ids))


def test_typical_acceptance_survives_rounds_that_draft_nothing():
    """The prefill (and any round without drafts) under a lossy rule is a plain sample from the target."""
    model = tiny_model("llama")
    heads = MedusaHeads(MedusaConfig.for_base_model(model, "tiny", num_heads=2))
    ids = _ids(batch=3)
    for num_draft in (0, "auto"):
        assistant = hf_kvspec.MedusaAssistant(heads, acceptance="typical", num_draft_tokens=num_draft,
                                              draft_vocab_size=None)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, max_new_tokens=3,
                             pad_token_id=0, custom_generate=hf_kvspec.speculative_generate, assistant=assistant,
                             return_dict_in_generate=True)
        assert out.sequences.shape == (3, ids.shape[1] + 3)
        assert out.acceptance.lossy


# ---------------------------------------------------------------------------------------------- protocol
def _attributes_read_on(module, names: tuple[str, ...]) -> set[str]:
    """Attribute names read as ``<name>.X`` or ``self.<name>.X`` in ``module``'s source."""
    found = set()
    for node in ast.walk(ast.parse(inspect.getsource(module))):
        if not isinstance(node, ast.Attribute):
            continue
        owner = node.value
        plain = isinstance(owner, ast.Name) and owner.id in names  # assistant.X
        on_self = isinstance(owner, ast.Attribute) and owner.attr in names  # self.assistant.X
        if plain or on_self:
            found.add(node.attr)
    return found


def test_the_loop_reads_only_what_the_assistant_base_declares():
    declared = set(dir(Assistant)) | set(vars(hf_kvspec.NgramAssistant()))  # class attributes + __init__ fields
    read = _attributes_read_on(loop, ("assistant",)) | _attributes_read_on(preflight, ("assistant",))
    assert read, "the parser found no reads: the test would pass vacuously"
    assert read <= declared, f"read but not declared on Assistant: {sorted(read - declared)}"


def test_the_loop_never_uses_getattr_on_an_assistant():
    for module in (loop, preflight):
        for node in ast.walk(ast.parse(Path(module.__file__).read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("getattr", "hasattr", "setattr"):
                text = ast.unparse(node.args[0])
                assert "assistant" not in text, f"{module.__name__}: {ast.unparse(node)}"


def test_the_loop_writes_nothing_onto_the_assistant(target):
    assistant = hf_kvspec.NgramAssistant(num_draft_tokens=3)
    before = set(vars(assistant))
    _speculative(target, _ids(), assistant)
    assert set(vars(assistant)) - before <= {"first_real"}  # the n-gram assistant's own per-call state


def test_drafter_is_a_deprecated_name_of_assistant():
    with pytest.warns(FutureWarning, match="Assistant"):
        assert hf_kvspec.Drafter is Assistant


class _Recorder(Assistant):
    """Proposes nothing; records the row count of every context (active rows only)."""

    def __init__(self):
        super().__init__(num_draft_tokens=1)
        self.rows_seen = []

    def release(self, rows):  # no per-row state: finished rows may leave
        self.staying(rows)

    def propose(self, ctx):
        self.rows_seen.append((ctx.buffer.tokens.shape[0], ctx.history.ids.shape[0], ctx.alive.shape[0]))
        return DraftProposal(ctx.buffer.tokens[:, -1:])


def test_contexts_hold_the_active_rows_only_after_rows_finish(target):
    """Row 1 stops at its first token (its EOS is whatever the target picks first): later contexts hold 2 rows."""
    ids = _ids(batch=3)
    first = _plain(target, ids)[:, ids.shape[1]]
    eos = int(first[1])
    assert eos not in first[[0, 2]].tolist() or pytest.skip("rows 0 and 2 would stop too")
    recorder = _Recorder()
    out = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=6,
                          pad_token_id=0, eos_token_id=eos, custom_generate=hf_kvspec.speculative_generate,
                          assistant=recorder)
    assert torch.equal(out, _plain(target, ids, max_new_tokens=6, eos_token_id=eos))
    assert recorder.rows_seen[0] == (2, 2, 2)  # row 1 left after the prefill that finished it


def test_eagle_drafter_is_a_deprecated_name_of_eagle_head():
    from hf_kvspec.heads.modeling_eagle import EagleHead

    with pytest.warns(FutureWarning, match="EagleHead"):
        from hf_kvspec.heads.modeling_eagle import EagleDrafter
    assert EagleDrafter is EagleHead
    assert "EagleDrafter" not in hf_kvspec.__all__ and "Drafter" not in hf_kvspec.__all__
