"""A layer-skip search runs once per model and settings; its result saves to JSON and loads back.

References: the number of times ``LayerSkipAssistant.search`` is entered (counted by patching the class in the
test only), a fresh search on the same prompt (what a reused result must equal), plain greedy ``generate`` (token
identity with a loaded skip set), the model's own config (the file's fingerprint).
"""

from __future__ import annotations

import gc
import json
import weakref

import pytest
import torch

from hf_kvspec.speculative.drafters.layer_skip import LayerSkipAssistant
from hf_kvspec.speculative.loop import speculative_generate
from tests.speculative.helpers import batch
from tests.tiny_models import tiny_model

LAYERS = 4
SETTINGS = dict(num_draft_tokens=3, calibration_tokens=8)  # on the seed-0 model this search skips [2, 3]


@pytest.fixture
def searches(monkeypatch):
    """The assistants that entered ``search``, in order (the search itself runs unchanged)."""
    entered = []
    original = LayerSkipAssistant.search

    def counted(self, prompt):
        entered.append(self)
        return original(self, prompt)

    monkeypatch.setattr(LayerSkipAssistant, "search", counted)
    return entered


def _model(seed=0, **overrides):
    return tiny_model("llama", seed=seed, **{"num_hidden_layers": LAYERS, **overrides})


def _run(model, assistant, size=2):
    ids, mask = batch(size)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, assistant=assistant,
                         custom_generate=speculative_generate, return_dict_in_generate=True)
    plain = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    return out, plain


def test_a_second_assistant_on_the_same_model_reuses_the_search(searches):
    model = _model()
    first, second = LayerSkipAssistant("search", **SETTINGS), LayerSkipAssistant("search", **SETTINGS)
    _run(model, first)
    out, plain = _run(model, second, size=3)  # another batch: the first search's prompt still stands
    assert searches == [first]
    assert (first.search_reused, second.search_reused) == (False, True)
    assert second.skip_layers == first.skip_layers == [2, 3]
    assert second.search_log == first.search_log and len(first.search_log) == LAYERS // 2
    assert torch.equal(out.sequences, plain)
    assert out.acceptance.draft_forwards > 0


def test_a_reused_result_equals_a_fresh_search_on_the_same_prompt(searches):
    model = _model()
    _run(model, LayerSkipAssistant("search", **SETTINGS))
    reused, fresh = LayerSkipAssistant("search", **SETTINGS), LayerSkipAssistant("search", reuse_search=False,
                                                                                 **SETTINGS)
    _run(model, reused)
    _run(model, fresh)
    assert searches[1:] == [fresh] and fresh.search_reused is False
    assert (reused.skip_layers, reused.search_log) == (fresh.skip_layers, fresh.search_log)


def test_another_model_or_other_settings_search_again(searches):
    model, twin = _model(seed=0), _model(seed=1)  # same config, other weights: the key is the model object
    _run(model, LayerSkipAssistant("search", **SETTINGS))
    on_twin = LayerSkipAssistant("search", **SETTINGS)
    _run(twin, on_twin)
    assert len(searches) == 2 and not on_twin.search_reused
    assert on_twin.skip_layers == []  # the seed-1 model's own search: nothing beats plain decoding there
    for changed in (dict(calibration_tokens=6), dict(patience=1), dict(num_draft_tokens=2)):
        assistant = LayerSkipAssistant("search", **{**SETTINGS, **changed})
        _run(model, assistant)
        assert searches[-1] is assistant and not assistant.search_reused, changed
    assert len(searches) == 5


def test_the_store_does_not_keep_the_model_alive():
    model = _model()
    _run(model, LayerSkipAssistant("search", **SETTINGS))
    alive = weakref.ref(model)
    del model
    gc.collect()
    assert alive() is None


def test_save_and_load_round_trip(tmp_path, searches):
    model = _model()
    searched = LayerSkipAssistant("search", **SETTINGS)
    _run(model, searched)
    path = searched.save_skip_layers(tmp_path / "skip.json")
    saved = json.loads(path.read_text())
    config = model.config
    assert saved["model"] == {"name_or_path": config.name_or_path, "model_type": "llama",
                              "num_hidden_layers": LAYERS, "hidden_size": config.hidden_size,
                              "vocab_size": config.vocab_size}
    assert saved["settings"] == {"calibration_tokens": 8, "patience": 3, "num_draft_tokens": 3}
    assert saved["skip_layers"] == [2, 3] and len(saved["search_log"]) == len(searched.search_log)

    for loaded in (LayerSkipAssistant.from_search(path, model), LayerSkipAssistant.from_search(str(path))):
        assert loaded.skip_layers == searched.skip_layers and loaded.search_log == searched.search_log
        assert (loaded.num_draft_tokens, loaded.calibration_tokens) == (3, 8)
        out, plain = _run(_model(), loaded, size=3)  # an equal model loaded anew: the file holds for it too
        assert torch.equal(out.sequences, plain) and out.acceptance.draft_forwards > 0
    assert searches == [searched]
    assert LayerSkipAssistant.from_search(path, num_draft_tokens="auto").num_draft_tokens == "auto"
    resaved = LayerSkipAssistant.from_search(path).save_skip_layers(tmp_path / "again.json")
    assert json.loads(resaved.read_text()) == saved


@pytest.mark.parametrize("other", [dict(num_hidden_layers=6), dict(vocab_size=128)])
def test_loading_on_another_config_is_refused(tmp_path, other):
    searched = LayerSkipAssistant("search", **SETTINGS)
    _run(_model(), searched)
    path = searched.save_skip_layers(tmp_path / "skip.json")
    name, value = next(iter(other.items()))
    stranger = _model(**other)
    message = rf"skip\.json .*{name} {_model().config.to_dict()[name]} vs {value}.*LayerSkipAssistant\('search'\)"
    with pytest.raises(ValueError, match=message):
        LayerSkipAssistant.from_search(path, stranger)
    with pytest.raises(ValueError, match=message):  # without a model: checked when generate starts
        _run(stranger, LayerSkipAssistant.from_search(path))


def test_a_searched_assistant_is_refused_on_another_config():
    searched = LayerSkipAssistant("search", **SETTINGS)
    _run(_model(), searched)
    with pytest.raises(ValueError, match=r"searched earlier.*num_hidden_layers 4 vs 6"):
        _run(_model(num_hidden_layers=6), searched)


def test_bad_files_and_saving_without_a_search_are_refused(tmp_path):
    with pytest.raises(ValueError, match="run generate with it once first"):
        LayerSkipAssistant([1]).save_skip_layers(tmp_path / "skip.json")
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"skip_layers": [1]}))
    with pytest.raises(ValueError, match=r"not a layer-skip search file.*save_skip_layers"):
        LayerSkipAssistant.from_search(other)
    searched = LayerSkipAssistant("search", **SETTINGS)
    _run(_model(), searched)
    saved = json.loads(searched.save_skip_layers(tmp_path / "skip.json").read_text())
    for change, match in ((dict(version=2), "version 2"), (dict(settings={"patience": 3}), "damaged")):
        broken = tmp_path / "broken.json"
        broken.write_text(json.dumps({**saved, **change}))
        with pytest.raises(ValueError, match=match):
            LayerSkipAssistant.from_search(broken)
