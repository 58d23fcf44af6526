"""Where a layer-skip search result is kept once found: in memory per model object, and in a JSON file.

Boundary: plain data (``SearchResult``: the skip set, the settings it was searched with, the model's config
fingerprint, the search log) and the two places it lives. Knows nothing about how the search runs
(``layer_skip.py`` does that) or about drafting.

Why an in-memory store: the search costs one calibration generation plus up to ``1.5 L`` teacher-forced forwards,
more than many short ``generate`` calls spend decoding, and a fresh ``LayerSkipAssistant("search")`` per call
would pay it every time. The store is a cache, not configuration: it is keyed by the model object through a weak
reference (the entry dies with the model, nothing is set on the model) plus everything else that changes the
result (``SearchSettings``, ``ModelFingerprint``). What the key leaves out, on purpose: the calibration prompt (the
first search's first prompt stands for the model) and in-place weight changes (fine-tuning, casting); pass
``reuse_search=False`` to the assistant for a fresh search after either matters.

File format (JSON, ``FORMAT``/``VERSION``)::

    {"format": "hf_kvspec/layer_skip_search", "version": 1, "skip_layers": [12, 17],
     "model": {"name_or_path": ..., "model_type": "llama", "num_hidden_layers": 30, "hidden_size": 576,
               "vocab_size": 49152},
     "settings": {"calibration_tokens": 16, "patience": 3, "num_draft_tokens": 4},
     "search_log": [{"skip_layers": [17], "agreement": 0.94, "estimated_speed": 1.1}, ...]}

A file is refused on a model whose fingerprint differs (``check_fingerprint``); ``name_or_path`` is recorded for
the reader and not compared (one model loaded from two paths is the same model).
"""

from __future__ import annotations

import json
import weakref
from dataclasses import asdict, dataclass, fields
from pathlib import Path

FORMAT = "hf_kvspec/layer_skip_search"
VERSION = 1

LogStep = tuple[tuple[int, ...], float, float]  # (skip set, agreement, estimated speed), one per search step


@dataclass(frozen=True)
class SearchSettings:
    """The assistant settings that change the search's result."""

    calibration_tokens: int
    patience: int
    num_draft_tokens: int  # the draft length N the estimated speed is computed for


@dataclass(frozen=True)
class ModelFingerprint:
    """The config fields a skip set depends on: a file is only valid for a model that matches all of them."""

    model_type: str
    num_hidden_layers: int
    hidden_size: int
    vocab_size: int

    @classmethod
    def of(cls, model) -> ModelFingerprint:
        return cls(**{f.name: getattr(model.config, f.name) for f in fields(cls)})

    def differences(self, other: ModelFingerprint) -> list[str]:
        """``"name: mine vs other"`` for every field that differs."""
        return [f"{f.name} {getattr(self, f.name)!r} vs {getattr(other, f.name)!r}" for f in fields(self)
                if getattr(self, f.name) != getattr(other, f.name)]


@dataclass(frozen=True)
class SearchResult:
    skip_layers: tuple[int, ...]
    log: tuple[LogStep, ...]
    settings: SearchSettings
    fingerprint: ModelFingerprint
    name_or_path: str = ""  # for the reader of a file; not part of any check


# model -> {(settings, fingerprint): result}; a result holds ints and floats only, so it never keeps a model alive
_RESULTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def remembered(model, settings: SearchSettings) -> SearchResult | None:
    """The result of an earlier search on this very model object with these settings, or None."""
    return _RESULTS.get(model, {}).get((settings, ModelFingerprint.of(model)))


def remember(model, result: SearchResult) -> None:
    """Keep ``result`` for later searches on ``model`` with the same settings (replaces an earlier one)."""
    _RESULTS.setdefault(model, {})[(result.settings, result.fingerprint)] = result


def check_fingerprint(result: SearchResult, model, where: str) -> None:
    """Raise ValueError when ``result`` (from ``where``) was searched on a model with another config."""
    differences = result.fingerprint.differences(ModelFingerprint.of(model))
    if differences:
        raise ValueError(
            f"{where} holds a skip set searched on another model ({result.name_or_path or 'unnamed'}; saved vs this "
            f"target: {', '.join(differences)}): search on this model with LayerSkipAssistant('search') and save "
            f"that with save_skip_layers, or load the file saved for this model")


# ---------------------------------------------------------------------------------------------------- JSON file
def save(result: SearchResult, path: str | Path) -> Path:
    path = Path(path)
    log = [{"skip_layers": list(skip), "agreement": agreement, "estimated_speed": speed}
           for skip, agreement, speed in result.log]
    path.write_text(json.dumps({
        "format": FORMAT, "version": VERSION, "skip_layers": list(result.skip_layers),
        "model": {"name_or_path": result.name_or_path, **asdict(result.fingerprint)},
        "settings": asdict(result.settings), "search_log": log}, indent=1) + "\n")
    return path


def load(path: str | Path) -> SearchResult:
    """The result saved in ``path``; ValueError naming the problem when it is not such a file."""
    try:
        data = json.loads(Path(path).read_text())
    except json.JSONDecodeError:
        data = None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"{path} is not a layer-skip search file (format {FORMAT!r}): write one with "
                         f"LayerSkipAssistant.save_skip_layers")
    if data.get("version") != VERSION:
        raise ValueError(f"{path} has version {data.get('version')!r}, this hf_kvspec reads version {VERSION}: "
                         f"save it again with this version's LayerSkipAssistant.save_skip_layers")
    try:
        model = dict(data["model"])
        name_or_path = model.pop("name_or_path", "")
        log = tuple((tuple(step["skip_layers"]), step["agreement"], step["estimated_speed"])
                    for step in data["search_log"])
        return SearchResult(tuple(data["skip_layers"]), log, SearchSettings(**data["settings"]),
                            ModelFingerprint(**model), name_or_path)
    except (KeyError, TypeError) as error:
        raise ValueError(f"{path} is a damaged layer-skip search file ({error!r}): search and save it again") from None
