"""The pure parts of ``scripts/benchmark.py peers`` and its worker protocol, with no peer package installed: argument
checks, agreement and table rows by hand, the worker driven over its pipe with the package-free echo peer, the
venv and converter bookkeeping with the installs faked, and ``Ours`` against plain greedy on a tiny model."""

from __future__ import annotations

import argparse
import io
import json
import sys
import tarfile
from pathlib import Path

import pytest
import torch

from tests.tiny_models import tiny_model

SCRIPTS = Path(__file__).resolve().parent.parent.parent / "scripts"
sys.path.insert(0, str(SCRIPTS))

from bench import peer_envs, peer_worker, peers, peers_report  # noqa: E402
from bench.peer_client import Generation, PeerError, PeerProcess  # noqa: E402


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    peers.add_arguments(parser)
    return parser.parse_args(argv)


def answer(tokens, eos=True, ttft=0.1, seconds=1.0) -> Generation:
    return Generation(list(tokens), eos, ttft, seconds)


# ------------------------------------------------------------------------------------------------ arguments
def test_default_methods_are_ours_then_the_peers():
    assert peers.methods(parse([])) == ["ours/plain", "ours/eagle", "ours/ngram", "llama.cpp", "llama.cpp+lookup",
                                        "llama.cpp-q4_1", "openvino", "openvino+lookup"]


def test_assistants_take_any_cli_spec_and_empty_lists_mean_none():
    args = parse(["--assistants", "medusa,lookahead:5:4:5,early_exit:8", "--peers", ""])
    assert peers.methods(args) == ["ours/plain", "ours/medusa", "ours/lookahead:5:4:5", "ours/early_exit:8"]
    assert peers.methods(parse(["--assistants", "", "--peers", "echo"])) == ["ours/plain", "echo"]
    assert peers.methods(parse(["--assistants", "self-int8", "--peers", "", "--stock"])) == [
        "ours/plain", "ours/self-int8", "transformers"]


@pytest.mark.parametrize("argv, message", [
    (["--peers", "llama.cpp,vllm"], "unknown peer"),
    (["--assistants", "self-int9"], "Unknown assistant"),
    (["--assistants", "early_exit:0"], "positive exit layer"),
    (["--max-new-tokens", "0"], "at least 1"),
])
def test_bad_arguments_are_refused_before_anything_loads(argv, message):
    with pytest.raises(ValueError, match=message):
        peers.methods(parse(argv))


def test_benchmark_lists_the_subcommand():
    import benchmark

    assert benchmark.SUBCOMMANDS["peers"] == "bench.peers"


# ------------------------------------------------------------------------------------------------ agreement, rows
def test_split_at_eos_and_common_prefix():
    assert peers_report.split_at_eos([5, 6, 2, 7], eos=[2]) == ([5, 6], True)
    assert peers_report.split_at_eos([5, 6], eos=[2, 3]) == ([5, 6], False)
    assert peers_report.common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
    assert peers_report.common_prefix([], [1]) == 0


def test_agreement_counts_the_reference_tokens_before_the_first_difference():
    reference = [answer([1, 2, 3, 4]), answer([5, 6]), answer([7, 8], eos=False)]
    other = [answer([1, 2, 9, 4]), answer([5, 6]), answer([7, 8], eos=True)]  # same tokens, other ending: not equal
    agree, identical = peers_report.agreement(reference, other)
    assert agree == pytest.approx((2 + 2 + 2) / 8) and identical == 1
    with pytest.raises(ValueError, match="2 to compare"):
        peers_report.agreement(reference, other[:2])


def test_rows_by_hand():
    results = {
        "ours/plain": [answer([1, 2, 3], seconds=1.0, ttft=0.2), answer([4, 5], eos=False, seconds=1.0, ttft=0.4)],
        "llama.cpp": [answer([1, 2, 3], seconds=0.5, ttft=0.1), answer([4, 6], eos=False, seconds=0.5, ttft=0.3)],
    }
    plain, llama = peers_report.rows("chat x2", results)
    # ours: 4 + 2 tokens (the first answer's EOS counts) in 2 s; llama.cpp the same tokens in 1 s
    assert plain == {"prompts": "chat x2", "method": "ours/plain", "tokens": 6, "tok_per_s": 3.0, "ttft_ms": 300.0,
                     "vs_llama_cpp": 0.5, "vs_ours_plain": 1.0, "agree": 1.0, "identical": "2/2"}
    assert llama["tok_per_s"] == 6.0 and llama["vs_ours_plain"] == 2.0 and llama["vs_llama_cpp"] == 1.0
    assert llama["agree"] == pytest.approx(0.8) and llama["identical"] == "1/2"  # 3 + 1 of 5 reference tokens


def test_rows_without_the_baselines_say_so():
    (row,) = peers_report.rows("chat x1", {"echo": [answer([1])]})
    assert row["vs_llama_cpp"] == row["vs_ours_plain"] == row["agree"] == row["identical"] == "-"


# ------------------------------------------------------------------------------------------------ worker protocol
def test_serve_answers_each_request_in_order():
    requests = io.StringIO("\n".join(json.dumps(r) for r in [
        {"op": "generate", "ids": [1], "max_new_tokens": 2, "eos": []},
        {"op": "load", "backend": "echo", "model": "-", "threads": 1, "options": {}},
        {"op": "generate", "ids": [3, 10], "max_new_tokens": 3, "eos": [2]},
        {"op": "generate", "ids": [10], "max_new_tokens": 5, "eos": [13]},
        {"op": "dance"},
    ]) + "\n")
    replies = io.StringIO()
    peer_worker.serve(requests, replies)
    first, load, plain, stopped, unknown = (json.loads(line) for line in replies.getvalue().splitlines())
    assert first == {"ok": False, "error": "RuntimeError: generate before load"}
    assert load["ok"] and load["info"]["version"] == "echo"
    assert plain["tokens"] == [11, 12, 13] and plain["eos"] is False
    assert stopped["tokens"] == [11, 12] and stopped["eos"] is True
    assert unknown == {"ok": False, "error": "ValueError: unknown op 'dance'"}


def test_peer_process_over_a_real_pipe():
    with PeerProcess("echo", sys.executable, "echo", "-", threads=1, options={"x": 1}) as peer:
        assert peer.info["options"] == {"x": 1} and peer.info["threads"] == 1
        result = peer.generate([7, 8], max_new_tokens=4, eos=[11])
        assert (result.tokens, result.eos, result.count) == ([9, 10], True, 3)
        assert 0 <= result.ttft_s <= result.seconds
    assert peer.process.returncode == 0  # end of input: the worker exits by itself


def test_peer_errors_name_the_peer():
    with pytest.raises(PeerError, match="peer nope: KeyError: 'nope'"):
        PeerProcess("nope", sys.executable, "nope", "-", threads=1)
    peer = PeerProcess("echo", sys.executable, "echo", "-", threads=1)
    peer.process.kill()
    peer.process.wait()
    with pytest.raises(PeerError, match="peer echo: the worker exited"):
        peer.generate([1], 2, [])


def test_the_worker_imports_none_of_our_stack():
    """It runs in venvs that hold only the peer."""
    imports = [line.strip() for line in (SCRIPTS / "bench" / "peer_worker.py").read_text().splitlines()
               if line.strip().startswith(("import ", "from "))]
    assert imports and not [line for line in imports
                            if any(name in line for name in ("torch", "transformers", "hf_kvspec", "bench"))]


# ------------------------------------------------------------------------------------------------ the run loop
class _Scripted:
    """A system that answers from a script and records the order it was called in."""

    def __init__(self, name, log, tokens):
        self.name, self.log, self.tokens = name, log, tokens

    def generate(self, ids, max_new_tokens, eos):
        self.log.append(self.name)
        return Generation(self.tokens[:max_new_tokens], False, 0.01, 0.1)


def test_measure_interleaves_methods_per_prompt(monkeypatch):
    monkeypatch.setattr(peers, "load_prompts", lambda kind, count: ["a", "b", "c"][:count])
    monkeypatch.setattr(peers, "chat_inputs", lambda tokenizer, prompts: {"input_ids": torch.tensor([[5, 6]])})
    log = []
    names = ["ours/plain", "echo", "other"]
    with PeerProcess("echo", sys.executable, "echo", "-", threads=1) as echo:
        systems = {"ours/plain": _Scripted("ours/plain", log, [7, 8, 9]), "echo": echo,
                   "other": _Scripted("other", log, [7, 0, 0])}
        report = peers._measure(parse(["--max-new-tokens", "3", "--num-prompts", "3", "--prompt-sets", "chat",
                                       "--name", "t"]), names, systems, None, [99])
    # the warm-up call of each, then per prompt an order rotated by one
    assert log == ["ours/plain", "other", "ours/plain", "other", "other", "ours/plain", "other", "ours/plain"]
    by_method = {row["method"]: row for row in report.rows}
    assert by_method["echo"]["identical"] == "3/3" and by_method["echo"]["agree"] == 1.0  # echo: 6 + 1 + i
    assert by_method["other"]["agree"] == 0.333  # 1 of 3 tokens per prompt, rounded


def test_ours_matches_plain_greedy_and_times_its_first_token():
    model = tiny_model("llama")
    ids = [5, 17, 33, 9]
    plain = model.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False, pad_token_id=2)[0, 4:].tolist()
    result = peers.Ours(model, None).generate(ids, 6, eos=[2])
    expected, stopped = peers_report.split_at_eos(plain, [2])
    assert (result.tokens, result.eos) == (expected, stopped)
    assert 0 < result.ttft_s <= result.seconds
    ngram = peers.Ours(model, "ngram").generate(ids, 6, eos=[2])
    assert (ngram.tokens, ngram.eos) == (expected, stopped)


# ------------------------------------------------------------------------------------------------ venvs, converter
def test_ensure_venv_installs_once_and_reuses(tmp_path, monkeypatch):
    commands = []

    def run(command, what, env=None):
        commands.append(command)
        if command[1:3] == ["-m", "venv"]:
            Path(command[3]).mkdir(parents=True)

    monkeypatch.setattr(peer_envs, "_run", run)
    env = peer_envs.PeerEnv("fake", ("pkg==1.0",), "fake_module", "nothing to build")
    python = peer_envs.ensure_venv(env, tmp_path)
    assert python == tmp_path / "fake" / "bin" / "python"
    assert commands[0][1:] == ["-m", "venv", str(tmp_path / "fake")]
    assert commands[1] == [str(python), "-m", "pip", "install", "pkg==1.0"]
    assert peer_envs.ensure_venv(env, tmp_path) == python and len(commands) == 2  # marker found: nothing runs
    changed = peer_envs.PeerEnv("fake", ("pkg==2.0",), "fake_module", "", remove=("extra",))
    peer_envs.ensure_venv(changed, tmp_path)  # other pins: made anew, then the unwanted package removed
    assert commands[-2][-1] == "pkg==2.0" and commands[-1][-3:] == ["uninstall", "--yes", "extra"]
    assert json.loads((tmp_path / "fake" / peer_envs.MARKER).read_text()) == changed.record()


def test_interpreter_prefers_ours_where_it_has_the_module(tmp_path, monkeypatch):
    monkeypatch.setattr(peer_envs, "ensure_venv", lambda env, root: root / env.name / "bin" / "python")
    assert peer_envs.interpreter(peer_envs.PeerEnv("j", (), "json", ""), tmp_path) == Path(sys.executable)
    missing = peer_envs.PeerEnv("m", (), "no_such_module_here", "")
    assert peer_envs.interpreter(missing, tmp_path) == tmp_path / "m" / "bin" / "python"
    assert peer_envs.interpreter(peer_envs.PeerEnv("j", (), "json", ""), tmp_path, use_current=False) == \
        tmp_path / "j" / "bin" / "python"


def test_converter_is_unpacked_from_the_sdist(tmp_path, monkeypatch):
    prefix = f"llama_cpp_python-{peer_envs.LLAMA_CPP_VERSION}/vendor/llama.cpp/"
    sdist = tmp_path / "src" / f"llama_cpp_python-{peer_envs.LLAMA_CPP_VERSION}.tar.gz"
    sdist.parent.mkdir()
    with tarfile.open(sdist, "w:gz") as tar:
        for name in ("convert_hf_to_gguf.py", "conversion/llama.py", "gguf-py/gguf/__init__.py", "ggml/big.c"):
            data = name.encode()
            info = tarfile.TarInfo(prefix + name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    installs = []
    monkeypatch.setattr(peer_envs, "_run", lambda command, what, env=None: installs.append(command))
    script, pythonpath = peer_envs._converter(tmp_path)
    home = tmp_path / "src" / f"llama.cpp-convert-{peer_envs.LLAMA_CPP_VERSION}"
    assert script == home / "convert_hf_to_gguf.py" and script.read_text() == "convert_hf_to_gguf.py"
    assert (home / "conversion" / "llama.py").is_file() and not (home / "ggml").exists()
    assert pythonpath == [home / "gguf-py", tmp_path / "convert-site"]
    assert installs and installs[0][-1] == "sentencepiece"
