"""``hf-kvspec generate --assistant medusa|eagle``: options checked before the model loads, the assistants built from
the bundled heads, and the side-by-side table of ``--compare-plain``."""

from __future__ import annotations

import types

import pytest
import torch

import hf_kvspec
from hf_kvspec.cli import _print_comparison, _speculative_kwargs, build_parser, main
from hf_kvspec.speculative.assistants import check_head_options, make_head_assistant
from hf_kvspec.speculative.draft_vocab import SHIPPED_SIZE
from hf_kvspec.speculative.stats import AcceptanceStats


@pytest.mark.parametrize(("argv", "message"), [
    (["--tree", "small"], "--tree apply to the bundled heads"),
    (["--assistant", "ngram", "--draft-vocab-size", "64"], "--draft-vocab-size apply to the bundled heads"),
    (["--assistant", "medusa", "--tree", "dynamic"], "Medusa takes default, small or chain"),
    (["--assistant", "eagle", "--tree", "wide"], "invalid choice"),
    (["--assistant", "eagle", "--draft-vocab-size", "0"], ">= 1"),
    (["--assistant", "eagle", "--draft-vocab-size", "2048"], "drop --draft-vocab-size"),  # EAGLE-3: its own vocab
    (["--compare-plain"], "--compare-plain apply to speculative decoding"),
])
def test_bad_head_options_stop_before_the_model_loads(monkeypatch, capsys, argv, message):
    import hf_kvspec.models

    monkeypatch.setattr(hf_kvspec.models, "load_bundled_model", lambda *a, **k: pytest.fail("model loaded"))
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "hi", *argv])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_head_options_defaults():
    assert check_head_options("medusa") == "small" and check_head_options("eagle") == "dynamic"
    assert check_head_options("medusa", "small", 4096) == "small"
    assert check_head_options("eagle", "small", "full") == "small"
    with pytest.raises(ValueError, match="8192-token vocabulary it was trained with"):
        check_head_options("eagle", "small", 4096)
    with pytest.raises(ValueError, match="bundled heads"):
        check_head_options("ngram")


@pytest.mark.parametrize(("kind", "tree", "cls"), [("medusa", None, hf_kvspec.MedusaAssistant),
                                                  ("eagle", "chain", hf_kvspec.EagleAssistant)])
def test_cli_builds_the_bundled_head_assistants(kind, tree, cls):
    vocab = ["--draft-vocab-size", "2048"] if kind == "medusa" else []  # the EAGLE-3 head drafts over its own
    argv = ["generate", "hi", "--assistant", kind, *vocab, "--num-draft-tokens", "auto"]
    args = build_parser().parse_args(argv + (["--tree", tree] if tree else []))
    args.check(args)
    assert args.num_draft_tokens == "auto"
    target = types.SimpleNamespace(dtype=torch.float32)  # the heads attach on the first call, not here
    assistant = _speculative_kwargs(args, target)["assistant"]
    assert isinstance(assistant, cls) and assistant.auto is not None
    shipped = make_head_assistant(kind, target)  # by default: the shipped ranking, or the head's trained vocabulary
    full = make_head_assistant(kind, target, draft_vocab_size="full")
    assert full.vocab is None
    if kind == "medusa":
        assert assistant.vocab.size == 2048 and shipped.vocab.size == SHIPPED_SIZE
    else:
        assert assistant.vocab is None and shipped.vocab is None and shipped.head.has_draft_vocab
        assert shipped.head.draft_vocab_ids().numel() == 8192


def test_compare_plain_table(capsys):
    stats = AcceptanceStats(row_rounds=4, emitted_tokens=10, drafted=[4, 3], accepted=[3, 2])
    ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]])
    out = types.SimpleNamespace(sequences=ids, acceptance=stats)
    plain = types.SimpleNamespace(sequences=ids.clone())
    _print_comparison("eagle", out, 1.0, plain, 2.0, prompt_len=2, greedy=True)
    text = capsys.readouterr().out
    assert "tokens/s" in text and "2.00x" in text and "2.50" in text and "0.75 0.67" in text
    assert text.strip().splitlines()[-1].split()[-1] == "yes"
