"""``make_assistant`` specs, the truncated stand-in draft, and ``hf-kvspec generate --assistant``."""

from __future__ import annotations

import pytest
import torch

import hf_kvspec
from hf_kvspec.cli import main
from hf_kvspec.speculative.assistants import make_assistant, parse_num_draft_tokens
from hf_kvspec.speculative.drafters.truncated import truncated_draft
from tests.tiny_models import tiny_model


def test_truncated_draft_is_the_first_layers_plus_head():
    target = tiny_model("llama", seed=0, num_hidden_layers=3)
    draft = truncated_draft(target, 1)
    assert draft.config.num_hidden_layers == 1 and target.config.num_hidden_layers == 3
    torch.testing.assert_close(draft.lm_head.weight, target.lm_head.weight)
    torch.testing.assert_close(draft.model.layers[0].mlp.up_proj.weight, target.model.layers[0].mlp.up_proj.weight)
    assert draft.lm_head.weight.data_ptr() != target.lm_head.weight.data_ptr()  # a copy, not shared storage
    with pytest.raises(ValueError, match=r"1\.\.3"):
        truncated_draft(target, 4)


def test_make_assistant_specs(tmp_path):
    target = tiny_model("llama", seed=0)
    assert isinstance(make_assistant("ngram", target, 8), hf_kvspec.NgramAssistant)
    truncated = make_assistant("draft:truncated:1", target, "auto")
    assert isinstance(truncated, hf_kvspec.DraftModelAssistant) and truncated.num_draft_tokens == "auto"
    tiny_model("llama", seed=5).save_pretrained(tmp_path / "draft")
    loaded = make_assistant(f"draft:{tmp_path / 'draft'}", target, 3)
    ids = torch.tensor([[5, 6, 7]])
    out = target.generate(ids, do_sample=False, max_new_tokens=8, pad_token_id=0,
                          custom_generate=hf_kvspec.speculative_generate, assistant=loaded)
    assert torch.equal(out, target.generate(ids, do_sample=False, max_new_tokens=8, pad_token_id=0))
    for bad in ("medusa", "draft:truncated:x", f"draft:{tmp_path / 'missing'}"):
        with pytest.raises(ValueError):
            make_assistant(bad, target)
    assert parse_num_draft_tokens("auto") == "auto" and parse_num_draft_tokens("6") == 6
    with pytest.raises(ValueError):
        parse_num_draft_tokens("-1")


@pytest.mark.slow
def test_cli_generate_with_ngram_reports_real_tau(capsys):
    prompt = "Repeat exactly: the red fox jumps over the lazy dog. the red fox jumps over the lazy dog."
    assert main(["generate", prompt, "--max-new-tokens", "16", "--assistant", "ngram", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    tau = float(next(line for line in out.splitlines() if line.startswith("tokens per target forward")).split()[-1])
    assert tau > 1.0 and "acceptance per position" in out


@pytest.mark.parametrize(("flags", "expected"), [([], None), (["--stock-kernels"], False),
                                                (["--decode-kernels"], True)])
def test_cli_decode_kernels_default_to_the_loops_choice(flags, expected):
    """No flag leaves the choice to the loop (on for fp32 CPU targets); ``--stock-kernels`` is the reference."""
    from hf_kvspec.cli import _speculative_kwargs, build_parser
    from tests.tiny_models import tiny_model

    args = build_parser().parse_args(["generate", "hi", "--assistant", "ngram", *flags])
    assert _speculative_kwargs(args, tiny_model("llama"))["decode_kernels"] is expected


def test_default_assistants_take_their_spec_default_draft_length():
    """``default_assistant`` is what ``hf-kvspec generate --assistant SPEC`` builds: K from ``default_draft_tokens``."""
    from hf_kvspec.speculative.assistants import default_assistant, default_draft_tokens
    from tests.tiny_models import tiny_model

    target = tiny_model("llama")
    assert default_draft_tokens("self-int8") == 8 and default_draft_tokens("lookahead:5:4:5") == "auto"
    assert default_assistant("ngram", target).num_draft_tokens == 4
    assert default_assistant("lookahead", target).num_draft_tokens == "auto"
