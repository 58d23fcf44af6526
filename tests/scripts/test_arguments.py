"""scripts/train_drafter.py and scripts/make_distill_data.py refuse every unusable argument while parsing, before
the model loads or data is built, with a message that names the fix (argparse's exit status 2)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.heads.tiny_base import save_tiny_base

SCRIPTS = Path(__file__).resolve().parent.parent.parent / "scripts"


@pytest.fixture(scope="module")
def scripts():
    sys.path.insert(0, str(SCRIPTS))
    import make_distill_data
    import train_drafter

    return train_drafter, make_distill_data


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = tmp_path_factory.mktemp("args")
    save_tiny_base(root / "base")
    (root / "corpus.txt").write_text("some text\n")
    return root


def _refused(parse, argv, capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        parse(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


TRAIN_CASES = [
    (["--train_vocab_size", "0"], "--train_vocab_size 0: needs an int >= 1"),
    (["--max_length", "0"], "--max_length 0: needs >= 2"),
    (["--gradient_accumulation_steps", "0"], "--gradient_accumulation_steps 0: needs an int >= 1"),
    (["--max_steps", "0"], "--max_steps 0: needs an int >= 1 (optimizer steps; 0 would save an untrained head)"),
    (["--num_heads", "0"], "--num_heads 0: needs an int >= 1"),
    (["--head", "eagle", "--draft_vocab_size", "0"], "--draft_vocab_size 0: needs an int >= 1"),
    (["--per_device_batch_size", "0"], "--per_device_batch_size 0: needs an int >= 1"),
    (["--learning_rate", "-1"], "--learning_rate -1.0: needs a number >= 0"),
    (["--head", "early_exit"], "--head early_exit needs --exit_layer E"),
    (["--head", "early_exit", "--exit_layer", "99"], "--exit_layer 99: the base model has 2 layers; use 1..1"),
    (["--head", "eagle", "--feature_layers", "1", "99"], "--feature_layers [99]: index the base model's hidden "
                                                          "states, -3..2"),
    (["--head", "eagle", "--draft_vocab_size", "5000"], "--draft_vocab_size 5000: the base vocabulary has 101 tokens"),
]


@pytest.mark.parametrize("extra,words", TRAIN_CASES, ids=[" ".join(c[0]) for c in TRAIN_CASES])
def test_train_drafter_refuses_at_parse_time(scripts, base, capsys, extra, words):
    train_drafter = scripts[0]
    head = [] if "--head" in extra else ["--head", "medusa"]
    argv = [*head, "--base_model", str(base / "base"), "--dataset", str(base / "corpus.txt"), *extra]
    assert words in _refused(train_drafter.parse_args, argv, capsys)


def test_train_drafter_config_errors(scripts, base, tmp_path, capsys):
    train_drafter = scripts[0]
    assert "--config needs a YAML file" in _refused(train_drafter.parse_args, ["--head", "medusa", "--config"], capsys)
    assert "no such file" in _refused(train_drafter.parse_args, ["--config", str(tmp_path / "x.yaml")], capsys)
    argv = ["--head", "medusa", "--base_model", str(tmp_path / "nowhere"), "--dataset", "x"]
    assert "--base_model" in _refused(train_drafter.parse_args, argv, capsys)


def test_train_drafter_accepts_good_arguments(scripts, base):
    m, _, t = scripts[0].parse_args(["--head", "early_exit", "--exit_layer", "1", "--base_model", str(base / "base"),
                                     "--dataset", str(base / "corpus.txt")])
    assert (m.exit_layer, t.max_steps) == (1, 200)


DISTILL_CASES = [
    (["--num_requests", "0", "--num_reading", "0"], "leave nothing to answer: ask for requests, reading tasks or "
                                                    "--prompts FILE"),
    (["--num_requests", "-1"], "--num_requests -1: needs an int >= 0"),
    (["--prompts", "/nonexistent.jsonl"], "--prompts /nonexistent.jsonl: no such file"),
    (["--prompts", str(SCRIPTS / "train_configs" / "chat_prompts_train.jsonl"), "--prompts_start", "240"],
     "has 240 rows; start below that"),
    (["--prompts_start", "-1"], "--prompts_start -1: needs an int >= 0"),
    (["--num_prompts", "0"], "--num_prompts 0: needs an int >= 1, or leave it unset"),
    (["--num_prompts", "5"], "slice a prompts file: pass --prompts FILE as well"),
    (["--num_reading", "-2"], "--num_reading -2: needs an int >= 0"),
    (["--follow_up_fraction", "2.0"], "--follow_up_fraction 2.0: needs a share in 0..1"),
    (["--batch_size", "0"], "--batch_size 0: needs an int >= 1"),
    (["--answer_temperature", "0"], "--answer_temperature 0.0: needs a number > 0"),
    (["--corpora", "nope"], "--corpora ['nope']: known corpora are"),
    (["--held_out", "/nonexistent.jsonl"], "--held_out /nonexistent.jsonl: no such file"),
    (["--sample", "5"], "--sample 5 needs --sample_output FILE"),
    (["--tasks", "explanation", "sonnet"], "--tasks ['explanation', 'sonnet']: give one or more distinct seed tasks"),
    (["--tasks", "poem", "poem"], "distinct seed tasks out of advice, code"),
]


@pytest.mark.parametrize("extra,words", DISTILL_CASES, ids=[" ".join(c[0]) for c in DISTILL_CASES])
def test_make_distill_data_refuses_at_parse_time(scripts, capsys, extra, words):
    assert words in _refused(scripts[1].parse_arguments, extra, capsys)


def test_make_distill_data_without_reading_tasks(scripts, base, tmp_path):
    """--num_reading 0 is legal: it wrote the data, then exited 1 on a missing 'reading' entry of the recipe."""
    output = tmp_path / "out.jsonl"
    argv = ["--base_model", str(base / "base"), "--num_reading", "0", "--num_requests", "2", "--batch_size", "2",
            "--request_max_new_tokens", "4", "--answer_max_new_tokens", "4", "--output", str(output)]
    assert scripts[1].main(argv) == 0
    assert output.is_file()


def test_reading_recipe_is_recorded_when_no_reading_tasks_are_asked():
    from hf_kvspec.heads.data import HeldOut
    from hf_kvspec.heads.self_instruct import RecipeSettings, _Filter, _reading

    recipe = {}
    assert _reading(RecipeSettings(num_reading=0), _Filter(HeldOut.from_prompts([])), recipe) == []
    assert recipe["reading"]["kept"] == 0 and recipe["reading"]["per_corpus"] == {}
