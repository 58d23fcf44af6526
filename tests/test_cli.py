"""The ``hf-kvspec`` command line: memory arithmetic and generation on the bundled model."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from hf_kvspec.cli import main


def test_memory_llama3_70b(capsys):
    assert main(["memory", "llama-3-70b", "--seq-len", "4096"]) == 0
    out = capsys.readouterr().out
    assert "per sequence: 1.25 GiB (1,342,177,280 B)" in out
    assert "per token:    320.00 KiB" in out


def test_memory_budget_and_batch(capsys):
    assert main(["memory", "llama-2-7b", "--seq-len", "4096", "--batch", "4", "--budget", "80GiB"]) == 0
    out = capsys.readouterr().out
    assert "total:        8.00 GiB" in out
    assert "max batch 33" in out  # (80 GiB - 12.55 GiB of fp16 weights) / 2 GiB per sequence


def test_memory_quantized(capsys):
    assert main(["memory", "llama-2-7b", "--seq-len", "4096", "--bits", "4", "--group-size", "64"]) == 0
    assert "per sequence: 576.00 MiB" in capsys.readouterr().out  # 2 GiB · 4.5/16


def test_memory_from_config_json(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
                                "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128}))
    assert main(["memory", str(tmp_path), "--seq-len", "10", "--dtype", "fp32"]) == 0
    assert "(5,120 B)" in capsys.readouterr().out  # 2 (K,V)·2 layers·2 heads·16 dim·4 B·10 tokens


def test_memory_unknown_config_is_a_clear_error(capsys):
    assert main(["memory", "no-such-model"]) == 2
    assert "is not a preset" in capsys.readouterr().err


def test_generate_streams_and_prints_stats(bundled, capsys):
    assert main(["generate", "Name a primary color.", "--max-new-tokens", "8", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    for row in ("tokens/s", "tokens per target forward", "KV bytes (dynamic)"):
        assert row in out


# --- validation before any model load; a --help without torch (issue 18, item 5) -------------------------------

@pytest.fixture
def no_model_load(monkeypatch):
    """Fail the test if the CLI tries to load a model: every case below must be refused before that."""
    import hf_kvspec.models

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the arguments were validated")

    monkeypatch.setattr(hf_kvspec.models, "load_bundled_model", refuse)


@pytest.mark.parametrize("argv,fragment", [
    (["generate", "hi", "--assistant", "nonsense"], "Unknown assistant 'nonsense'"),
    (["generate", "hi", "--assistant", "draft:truncated:x"], "layer count"),
    (["generate", "hi", "--assistant", "draft:truncated:0"], "at least 1"),
    (["generate", "hi", "--assistant", "draft:/no/such/dir"], "no config.json"),
    (["generate", "hi", "--assistant", "ngram", "--num-draft-tokens", "-1"], "--num-draft-tokens"),
    (["generate", "hi", "--num-draft-tokens", "4"], "--assistant"),
    (["generate", "hi", "--decode-kernels"], "--assistant"),
    (["generate", "hi", "--max-new-tokens", "-5"], "--max-new-tokens"),
    (["generate", "hi", "--max-new-tokens", "0"], "--max-new-tokens"),
    (["generate", "hi", "--temperature", "-1"], "--temperature"),
    (["generate", "hi", "--temperature", "nan"], "--temperature"),
    (["generate", "hi", "--threads", "0"], "--threads"),
    (["generate", "hi", "--model", "no-such-model"], "--model"),
    (["memory", "llama-2-7b", "--budget=-5GiB"], "--budget"),
    (["memory", "llama-2-7b", "--budget", "lots"], "--budget"),
    (["memory", "llama-2-7b", "--group-size", "32"], "--bits"),
    (["memory", "llama-2-7b", "--residual-length", "128"], "--bits"),
    (["memory", "llama-2-7b", "--seq-len", "-1"], "--seq-len"),
    (["memory", "llama-2-7b", "--batch", "0"], "--batch"),
    (["memory", "llama-2-7b", "--bits", "4", "--group-size", "3"], "group_size=3"),
])
def test_bad_arguments_are_refused_before_the_model_loads(no_model_load, capsys, argv, fragment):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert fragment in capsys.readouterr().err


def test_malformed_json_config_names_its_file(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text("{not json")
    assert main(["memory", str(path)]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and "JSON" in err


def test_budget_smaller_than_the_weights_says_so(capsys):
    assert main(["memory", "llama-2-7b", "--budget", "1GiB"]) == 0
    assert "weights alone exceed the budget" in capsys.readouterr().out


@pytest.mark.parametrize("code", [
    "import hf_kvspec.cli",
    "from hf_kvspec.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass",
    "from hf_kvspec.cli import main\ntry:\n    main(['generate', '--help'])\nexcept SystemExit:\n    pass",
    "from hf_kvspec.cli import main\ntry:\n    main(['memory', '--help'])\nexcept SystemExit:\n    pass",
])
def test_help_does_not_import_torch(code):
    probe = code + "\nimport sys\nprint('torch' in sys.modules, 'transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "False False"


@pytest.mark.parametrize("cache", ["int8", "fp8"])
@pytest.mark.parametrize("assistant", ["medusa", "eagle"])
def test_tree_assistants_on_per_token_quantized_caches_pass_the_checks(cache, assistant):
    """int8/fp8 keep a tree's accepted path among their per-token codes (#29 item 2): no refusal any more."""
    from hf_kvspec.cli import build_parser

    args = build_parser().parse_args(["generate", "hi", "--cache", cache, "--assistant", assistant])
    args.check(args)  # no SystemExit


def test_tree_chain_on_int8_passes_the_checks():
    from hf_kvspec.cli import build_parser

    args = build_parser().parse_args(["generate", "hi", "--cache", "int8", "--assistant", "medusa", "--tree", "chain"])
    args.check(args)  # no SystemExit


def _paged_tree_run(max_tokens):
    """A tiny Llama with a 26-node Medusa tree on the paged pool `make_cache` sizes for ``max_tokens``."""
    import hf_kvspec
    from hf_kvspec.cache.factory import make_cache
    from hf_kvspec.heads.configuration import MedusaConfig
    from hf_kvspec.heads.modeling_medusa import MedusaHeads
    from tests.tiny_models import tiny_model

    model = tiny_model("llama")
    torch.manual_seed(0)
    heads = MedusaHeads(MedusaConfig.for_base_model(model, "tiny", num_heads=4))
    assistant = hf_kvspec.MedusaAssistant(heads, tree="default", num_draft_tokens=None, draft_vocab_size=None)
    ids = torch.randint(3, 90, (1, 16), generator=torch.Generator().manual_seed(1))
    kwargs = dict(attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=16, pad_token_id=0)
    plain = model.generate(ids, **kwargs)
    cache = make_cache("paged", model.config, max_tokens=max_tokens(assistant))
    out = model.generate(ids, cache=cache, custom_generate=hf_kvspec.speculative_generate, assistant=assistant,
                         **kwargs)
    return out, plain


def test_the_paged_pool_is_sized_for_a_tree_round():
    """#29 item 7: a pool for prompt + answer (+ one spare block) cannot hold the last round's 26-node tree;
    ``cache_tokens`` adds the tree's width, and the run is then token-identical to plain decoding."""
    from hf_kvspec.cache.block_pool import OutOfBlocksError
    from hf_kvspec.cli import cache_tokens

    with pytest.raises(OutOfBlocksError):  # the old sizing: 2 + 1 blocks of 16 for 16 + 16 tokens
        _paged_tree_run(lambda assistant: 16 + 16)
    out, plain = _paged_tree_run(lambda assistant: cache_tokens(16, 16, assistant))
    assert torch.equal(out, plain)
    assert cache_tokens(16, 16, None) == 32  # plain decoding and chains: no extra room


@pytest.mark.parametrize("flags", [[], ["--reference-forward"]])
def test_reference_forward_reaches_generate_batch_and_serve(flags):
    """``--reference-forward`` asks every command for the model's own forward (``fast_forward=False``); without it
    the choice is the library's (``None``: the fast forward where it applies)."""
    from hf_kvspec.cli import _speculative_kwargs, build_parser
    from tests.tiny_models import tiny_model

    expected = False if flags else None
    args = build_parser().parse_args(["generate", "hi", *flags])
    kwargs = _speculative_kwargs(args, tiny_model("llama"))
    assert kwargs["assistant"] is None and kwargs["fast_forward"] is expected  # plain decoding through the loop
    for command in (["batch", "prompts.jsonl", "--out", "out.jsonl"], ["serve", "--bundled"]):
        assert build_parser().parse_args([*command, *flags]).reference_forward is bool(flags)


def test_kernels_are_calibrated_only_for_the_modules_the_call_routes(monkeypatch):
    """With the fast forward running the target, settling the target's layers would copy weights nobody routes:
    only the drafter's modules are calibrated; without it, the target's too."""
    from hf_kvspec import cli
    from hf_kvspec.kernels import linear
    from hf_kvspec.speculative.drafters.draft_model import DraftModelAssistant
    from tests.tiny_models import tiny_model

    seen = []

    class Recording:
        def __init__(self, *modules, **kwargs):
            seen.append(modules)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def calibrate(self, max_rows=None):
            return 0.0

    monkeypatch.setattr(linear, "DecodeKernels", Recording)
    target, draft = tiny_model("llama", seed=0), tiny_model("llama", seed=1)
    speculative = {"assistant": DraftModelAssistant(draft, 2), "decode_kernels": None}
    cli._calibrate_kernels(target, speculative, target_routed=False)
    cli._calibrate_kernels(target, speculative, target_routed=True)
    cli._calibrate_kernels(target, {**speculative, "assistant": None}, target_routed=True)
    assert seen == [(draft,), (draft, target)]
