"""``hf-kvspec batch`` never loses finished work (issue 40 item 6): lines and paths are checked before the model
loads, each result is written as it finishes, the input is never overwritten, ``--resume`` continues a partly
written output and Ctrl-C keeps what finished. A tiny model stands in for the bundled one (``load_bundled_model``
patched), so every check that must happen *before* it loads can assert it never did."""

from __future__ import annotations

import json

import pytest

import hf_kvspec.models
from hf_kvspec.cli import main
from tests.tiny_models import tiny_model

from .helpers import greedy_reference, random_prompts
from .test_offline import CharTokenizer


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


@pytest.fixture
def loads(monkeypatch, llama):
    """Patch the bundled model loader; the list records each load."""
    calls = []

    def load(name):
        calls.append(name)
        return llama, CharTokenizer()
    monkeypatch.setattr(hf_kvspec.models, "load_bundled_model", load)
    return calls


def _write(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def _batch(source, out, *flags):
    return main(["batch", str(source), "--out", str(out), "--threads", "1", "--no-progress", "--kv-budget", "64",
                 "--block-size", "4", "--max-new-tokens", "5", *flags])


def _ids(path):
    return [json.loads(line)["id"] for line in path.read_text().splitlines()]


@pytest.mark.parametrize("records, fragment", [
    ([{"input_ids": [5, 6]}, {"prompt": "a", "temperature": "hot"}], "p.jsonl:2: \"temperature\""),
    ([{"input_ids": [5, 6]}, {"prompt": "a", "stop": ""}], "p.jsonl:2: \"stop\""),
    ([{"input_ids": [5, 6]}, "{oops"], "p.jsonl:2: not valid JSON"),
])
def test_bad_lines_fail_before_the_model_loads(tmp_path, loads, capsys, records, fragment):
    source = _write(tmp_path / "p.jsonl", records)
    with pytest.raises(SystemExit):
        _batch(source, tmp_path / "out.jsonl")
    assert fragment in capsys.readouterr().err and not loads
    assert not (tmp_path / "out.jsonl").exists()


@pytest.mark.parametrize("case, fragment", [
    ("missing prompts", "no such prompts file"),
    ("out in a missing directory", "does not exist; create it first"),
    ("out is the input", "is the prompts file itself"),
    ("out exists", "exists; pass --resume"),
])
def test_bad_paths_fail_before_the_model_loads(tmp_path, loads, capsys, case, fragment):
    source = _write(tmp_path / "p.jsonl", [{"input_ids": [5, 6]}])
    out = {"missing prompts": tmp_path / "out.jsonl", "out in a missing directory": tmp_path / "no" / "out.jsonl",
           "out is the input": source, "out exists": _write(tmp_path / "old.jsonl", ["keep me"])}[case]
    if case == "missing prompts":
        source = tmp_path / "absent.jsonl"
    with pytest.raises(SystemExit):
        _batch(source, out)
    assert fragment in capsys.readouterr().err and not loads
    assert source.read_text() == '{"input_ids": [5, 6]}\n' if source.exists() else True
    if case == "out exists":
        assert out.read_text() == "keep me\n"


def test_an_out_of_vocabulary_line_is_refused_before_any_round(tmp_path, loads, capsys):
    """Issue 40: one id >= vocab ended the run with a traceback and lost the good lines' results."""
    source = _write(tmp_path / "p.jsonl", [{"input_ids": [5, 6]}, {"input_ids": [5, 500], "id": "bad"}])
    assert _batch(source, tmp_path / "out.jsonl") == 2
    err = capsys.readouterr().err
    assert "id 'bad'" in err and "outside the model's vocabulary" in err and "Traceback" not in err
    assert (tmp_path / "out.jsonl").read_text() == ""  # nothing ran, nothing to lose


def test_results_are_written_as_they_finish_and_resume_runs_the_rest(tmp_path, loads, llama, monkeypatch):
    prompts = random_prompts([6, 9, 4, 7], seed=41)
    source = _write(tmp_path / "p.jsonl", [{"input_ids": p} for p in prompts])
    out = tmp_path / "out.jsonl"
    from hf_kvspec.serving import offline

    original, seen = offline.ResultWriter.__call__, []

    def interrupt_after_two(self, result):  # the file holds each result before the next one is produced
        original(self, result)
        seen.append(_ids(out))
        if len(seen) == 2:
            raise KeyboardInterrupt
    monkeypatch.setattr(offline.ResultWriter, "__call__", interrupt_after_two)
    with pytest.raises(SystemExit) as exit_:
        _batch(source, out)
    assert exit_.value.code == 130 and [len(ids) for ids in seen] == [1, 2]
    monkeypatch.setattr(offline.ResultWriter, "__call__", original)
    with out.open("a") as f:
        f.write('{"id": 4, "outp')  # a write cut short by the interrupt: that request runs again
    assert _batch(source, out, "--resume") == 0
    assert sorted(_ids(out)) == [1, 2, 3, 4] and len(loads) == 2
    results = {json.loads(line)["id"]: json.loads(line) for line in out.read_text().splitlines()}
    for number, prompt in enumerate(prompts, start=1):
        assert results[number]["output_ids"] == greedy_reference(llama, prompt, 5)


def test_the_suffix_pool_is_saved_and_warms_a_later_run(tmp_path, loads, llama, capsys, monkeypatch):
    """``--assistant suffix --save-pool`` then ``--warm-pool`` (the saved pool, or the first run's results): the
    second run drafts the first run's outputs from its first round, and outputs stay plain greedy. (Every request
    drafts: on a tiny model the goodput choice may rightly decide that drafting does not pay.)"""
    import hf_kvspec.serving.engine as engine_module

    monkeypatch.setattr(engine_module.Engine.__init__, "__kwdefaults__",
                        {**engine_module.Engine.__init__.__kwdefaults__, "draft_lengths": "fixed"})
    prompts = random_prompts([6, 9, 7], seed=4, vocab=12)
    source = _write(tmp_path / "p.jsonl", [{"input_ids": p, "max_new_tokens": 12} for p in prompts])
    assert _batch(source, tmp_path / "first.jsonl", "--assistant", "suffix", "--save-pool", str(tmp_path / "pool.jsonl")) == 0
    first = [json.loads(line) for line in (tmp_path / "first.jsonl").read_text().splitlines()]
    assert all(r["output_ids"] == greedy_reference(llama, prompts[r["id"] - 1], 12) for r in first)
    assert "suffix pool: 3 sequences ->" in capsys.readouterr().out
    for warm in ("pool.jsonl", "first.jsonl"):
        out = tmp_path / f"warm-{warm}"
        assert _batch(source, out, "--assistant", "suffix", "--warm-pool", str(tmp_path / warm)) == 0
        again = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
        assert all(again[r["id"]]["output_ids"] == r["output_ids"] for r in first)
        assert min(r["tau"] for r in again.values()) > 2, warm  # each request drafts its earlier output
        assert "suffix pool: 3 sequences from" in capsys.readouterr().err


@pytest.mark.parametrize("flags, fragment", [
    (["--warm-pool", "x.jsonl"], "apply to the suffix pool; add --assistant suffix"),
    (["--assistant", "ngram", "--save-pool", "p.jsonl"], "apply to the suffix pool"),
    (["--assistant", "suffix", "--warm-pool", "missing.jsonl"], "--warm-pool missing.jsonl: no such file"),
    (["--assistant", "suffix+self-int8"], "two assistants are suffix and one model drafter"),
    (["--assistant", "suffix+early_exit"], "early_exit is self-speculation"),
])
def test_pool_flags_are_checked_before_the_model_loads(tmp_path, loads, capsys, flags, fragment, monkeypatch):
    monkeypatch.chdir(tmp_path)
    source = _write(tmp_path / "p.jsonl", [{"input_ids": [5, 6]}])
    with pytest.raises(SystemExit):
        _batch(source, tmp_path / "out.jsonl", *flags)
    assert fragment in capsys.readouterr().err and not loads
