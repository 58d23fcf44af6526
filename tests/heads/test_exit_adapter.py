"""ExitAdapter: config checks, exact save/load, pairing through EarlyExitAssistant, the loss against a plain
full-vocabulary cross-entropy, and the teacher-forced chain tau against the tau of the real decoding loop.

References: ``torch.nn.functional.cross_entropy`` over the full vocabulary (loss), plain ``generate`` (tokens), the
loop's own AcceptanceStats (tau), a model without adapter (the untrained adapter is the identity).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import hf_kvspec
from hf_kvspec.heads.configuration_exit import ExitAdapterConfig
from hf_kvspec.heads.distill import Conversation
from hf_kvspec.heads.evaluation_exit import evaluate_exit_adapter
from hf_kvspec.heads.modeling_exit import ExitAdapter, exit_loss
from hf_kvspec.heads.objectives import TrainingVocabulary
from hf_kvspec.heads.pairing import BaseModelMismatchError
from hf_kvspec.speculative.drafters.early_exit import EarlyExitAssistant
from hf_kvspec.speculative.loop import speculative_generate
from tests.speculative.helpers import batch
from tests.tiny_models import tiny_model

LAYERS = 4


def _base(seed: int = 0):
    return tiny_model("llama", seed=seed, num_hidden_layers=LAYERS)


def _adapter(base, exit_layer: int, scale: float = 0.0, seed: int = 0) -> ExitAdapter:
    """An adapter for ``base``; ``scale`` > 0 gives its zero-initialised output projection random weights."""
    adapter = ExitAdapter(ExitAdapterConfig.for_base_model(base, "tiny", exit_layer=exit_layer)).attach(base)
    if scale:
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            adapter.down_proj.weight.copy_(torch.randn(adapter.down_proj.weight.shape, generator=gen) * scale)
    return adapter.eval()


@pytest.mark.parametrize("bad,words", [(dict(exit_layer=0), "exit_layer"), (dict(exit_layer=4), "exit_layer"),
                                       (dict(exit_layer=True), "exit_layer"), (dict(intermediate_size=0), "intermediate"),
                                       (dict(rms_norm_eps=0.0), "rms_norm_eps")])
def test_config_refuses_bad_fields(bad, words):
    with pytest.raises(Exception, match=words):  # huggingface_hub's strict dataclasses wrap the ValueError
        ExitAdapterConfig(**{"base_num_layers": 4, "exit_layer": 2, **bad})


def test_save_load_round_trip_is_exact(tmp_path):
    base = _base()
    adapter = _adapter(base, 2, scale=0.1)
    adapter.save_pretrained(tmp_path)
    loaded = ExitAdapter.from_pretrained(tmp_path).attach(base).eval()
    fields = lambda config: {k: v for k, v in config.to_dict().items() if k != "_name_or_path"}  # noqa: E731
    assert fields(loaded.config) == fields(adapter.config)
    ours, theirs = adapter.state_dict(), loaded.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    hidden = torch.randn(2, 5, base.config.hidden_size)
    assert torch.equal(adapter.logits(hidden), loaded.logits(hidden))
    hf_kvspec.register()
    try:
        from transformers import AutoModel

        assert type(AutoModel.from_pretrained(tmp_path)) is ExitAdapter
    finally:
        hf_kvspec.unregister()


def test_untrained_adapter_is_the_identity_and_drafts_like_no_adapter():
    base = _base()
    adapter = _adapter(base, 2)
    hidden = torch.randn(2, 5, base.config.hidden_size)
    assert torch.equal(adapter(hidden), hidden)
    ids, mask = batch(3)
    runs = [base.generate(ids, attention_mask=mask, max_new_tokens=12, custom_generate=speculative_generate,
                          assistant=assistant, return_dict_in_generate=True, do_sample=False)
            for assistant in (EarlyExitAssistant(2, 3), EarlyExitAssistant(None, 3, adapter=_adapter(base, 2)))]
    assert torch.equal(runs[0].sequences, runs[1].sequences)
    counts = [{k: v for k, v in run.acceptance.summary().items() if not k.endswith("_time_s")} for run in runs]
    assert counts[0] == counts[1]


def test_assistant_attaches_the_adapter_and_refuses_another_base_model_or_exit_layer():
    base, other = _base(), _base(seed=1)
    ids, mask = batch(1)
    adapter = _adapter(base, 2)
    with pytest.raises(BaseModelMismatchError):
        other.generate(ids, attention_mask=mask, max_new_tokens=4, custom_generate=speculative_generate,
                       assistant=EarlyExitAssistant(2, 3, adapter=adapter))
    with pytest.raises(ValueError, match="exit_layer=2"):
        EarlyExitAssistant(3, 3, adapter=adapter)
    with pytest.raises(ValueError, match="exit_layer=E"):
        EarlyExitAssistant(None, 3)


def test_exit_loss_equals_full_vocabulary_cross_entropy():
    base = _base()
    adapter = _adapter(base, 2, scale=0.2)
    ids, mask = batch(3)
    out = base(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    batch_ = {"features": out.hidden_states[2], "target_tokens": out.logits.argmax(-1), "valid": mask.bool()}
    found = exit_loss(adapter, batch_, TrainingVocabulary(base.config.vocab_size))
    logits = base.lm_head(base.model.norm(adapter(out.hidden_states[2])))            # independent path, [B, T, V]
    real = mask.bool()
    expected = F.cross_entropy(logits[real], batch_["target_tokens"][real])
    torch.testing.assert_close(found.loss, expected, atol=1e-6, rtol=1e-5)  # fp32: same products, summed in order
    assert found.correct.item() == (logits[real].argmax(-1) == batch_["target_tokens"][real]).sum().item()
    assert found.counts.item() == real.sum().item()


def test_exit_loss_answers_only_skips_rows_that_predict_prompt_tokens():
    base = _base()
    adapter = _adapter(base, 2, scale=0.2)
    ids, mask = batch(3)
    out = base(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    prompt = torch.tensor([2, 0, 4])
    batch_ = {"features": out.hidden_states[2], "target_tokens": out.logits.argmax(-1), "valid": mask.bool(),
              "input_ids": ids, "prompt_length": prompt}
    found = exit_loss(adapter, batch_, TrainingVocabulary(base.config.vocab_size), answers_only=True)
    logits = base.lm_head(base.model.norm(adapter(out.hidden_states[2])))            # [B, T, V]
    # row t predicts token t+1: scored when t + 1 >= prompt_length (and the row is real)
    kept = mask.bool() & (torch.arange(ids.shape[1])[None] + 1 >= prompt[:, None])
    assert 0 < kept.sum() < mask.sum()
    expected = F.cross_entropy(logits[kept], batch_["target_tokens"][kept])
    torch.testing.assert_close(found.loss, expected, atol=1e-6, rtol=1e-5)
    assert found.counts.item() == kept.sum().item()


@pytest.mark.parametrize("scale,exit_layer", [(0.0, 3), (0.3, 3), (0.6, 3)])
def test_teacher_forced_chain_tau_equals_the_decoding_loop(scale, exit_layer):
    """The evaluation's claim: on the target's own greedy text, the teacher-forced walk is what the loop does."""
    base = _base()
    adapter = _adapter(base, exit_layer, scale=scale)
    prompt = [5, 6, 7, 8, 9]
    new = 24
    ids = torch.tensor([prompt])
    out = base.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                        custom_generate=speculative_generate, assistant=EarlyExitAssistant(None, 4, adapter=adapter),
                        return_dict_in_generate=True, do_sample=False)
    response = out.sequences[0, len(prompt):].tolist()
    assert response == base.generate(ids, max_new_tokens=new, do_sample=False)[0, len(prompt):].tolist()
    result = evaluate_exit_adapter(adapter, base, [Conversation(prompt, response)], depth=4)
    # the walk covers all n tokens but counts no forward for the first one (the loop's prefill emits it); at the end
    # the loop caps its drafts at max_new_tokens while the walk stops scoring at the last token, which can save or
    # cost one round: equal up to 1 forward (a one-row shift of the drafts moves tau by many)
    assert result["emitted_tokens"] == new
    assert abs(result["target_forwards"] + 1 - out.acceptance.target_forwards) <= 1
    assert out.acceptance.target_forwards < new  # some drafts were accepted: the walk was tested, not just counted
