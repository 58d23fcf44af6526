"""``hf-kvspec serve`` from the command line (argument refusals, a saved model directory served end to end) and
``scripts/load_test.py`` smoke-tested against a tiny server: a bounded load with disconnecting clients, zero
5xx, greedy outputs equal to ``generate()`` and the pool back to full."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import openai
import pytest

from hf_kvspec.cli import main
from hf_kvspec.serving.engine import Engine
from tests.tiny_models import tiny_model

from .server_harness import RunningServer, greedy_ids, no_leaks, tiny_tokenizer
from .test_server_faults import free_port, wait_healthy

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


@pytest.mark.parametrize(("argv", "message"), [
    (["serve"], "exactly one of MODEL"),
    (["serve", "some/model", "--bundled"], "exactly one of MODEL"),
    (["serve", "--bundled", "no-such-model"], "not a bundled model"),
    (["serve", "m", "--max-running", "64", "--max-tokens-per-round", "32"], "--max-running 64"),
    (["serve", "m", "--port", "-1"], "needs an integer >= 0"),
    (["serve", "m", "--kv-budget", "lots"], "--kv-budget"),
    (["serve", "m", "--port", "99999"], "needs a TCP port in 0..65535, got 99999"),
    (["serve", "m", "--kv-budget", "-1GB"], "--kv-budget -1GB: needs a value >= 0"),
    (["serve", "m", "--kv-budget=-1GB"], "needs a positive size"),
    (["serve", "m", "--max-body-bytes", "0"], "needs a positive size"),
])
def test_bad_serve_arguments_exit_2_naming_the_fix(argv, message, capsys):
    with pytest.raises(SystemExit) as caught:
        main(argv)
    assert caught.value.code == 2
    assert message in capsys.readouterr().err


def test_a_busy_port_is_refused_before_the_model_loads(capsys, monkeypatch):
    import socket

    import transformers

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        lambda *a, **k: pytest.fail("the model loaded before the port was checked"))
    with socket.create_server(("127.0.0.1", 0)) as busy, pytest.raises(SystemExit) as caught:
        main(["serve", "some/model", "--port", str(busy.getsockname()[1])])
    assert caught.value.code == 2 and "cannot listen on --host 127.0.0.1" in capsys.readouterr().err


def test_a_speculating_engine_serves_greedy_output_equal_to_generate():
    """The server on an engine with an n-gram assistant: the same greedy tokens as ``generate``, blocks freed."""
    model, tokenizer = tiny_model("llama"), tiny_tokenizer()
    engine = Engine(model, tokenizer, kv_budget=64, block_size=4, max_tokens_per_round=32, max_running=8,
                    assistant="ngram")
    prompt = "t7 t19 t7 t19 t7 t19 t7 t19 t7"  # repetitive: the n-gram lookup drafts
    with RunningServer(engine) as server, no_leaks(server):
        response = server.client().completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
    assert response.kvspec["choices"][0]["token_ids"] == greedy_ids(model, tokenizer(prompt)["input_ids"], 12)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The tiny model and tokenizer saved as a model directory (what ``serve MODEL`` and the load test load)."""
    root = tmp_path_factory.mktemp("tiny-served")
    model = tiny_model("llama")
    model.save_pretrained(root)
    tiny_tokenizer().save_pretrained(root)
    return root, model


def test_serve_a_model_directory_then_sigterm(saved):
    root, model = saved
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "hf_kvspec.cli", "serve", str(root), "--port", str(port),
                                "--kv-budget", "64", "--block-size", "4", "--threads", "1", "--log-level", "warning"],
                               env={**os.environ, "OMP_NUM_THREADS": "1"}, stderr=subprocess.PIPE, text=True)
    try:
        wait_healthy(port, process)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list().data] == [str(root)]
        response = client.chat.completions.create(model=str(root), messages=[{"role": "user", "content": "t9 t8"}],
                                                  max_tokens=5, temperature=0)
        assert response.kvspec["choices"][0]["token_ids"] == greedy_ids(model, [4, 9, 8, 5], 5)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_load_test_script_smoke(saved, tmp_path):
    root, model = saved
    sys.path.insert(0, str(SCRIPTS))
    import load_test

    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(["t7 t8 t9", "t40 t41", "t12 t13 t14 t15 t16", "t90"]))
    engine = Engine(model, tiny_tokenizer(), kv_budget=64, block_size=4, max_tokens_per_round=32, max_running=4)
    out = tmp_path / "summary.json"
    with RunningServer(engine) as server:
        code = load_test.main(["--base-url", server.base_url, "--requests", "24", "--concurrency", "6",
                               "--disconnect-fraction", "0.25", "--max-tokens", "12", "--max-seconds", "120",
                               "--prompts", str(prompts), "--reference", str(root), "--seed", "3",
                               "--out", str(out)])
    summary = json.loads(out.read_text())
    assert code == 0, summary
    assert summary["status_5xx"] == 0 and summary["greedy_mismatches"] == 0 and summary["pool_back_to_full"]
    assert summary["disconnected"] > 0 and summary["completed"] + summary["disconnected"] == 24
    assert summary["ttft_p50_s"] is not None and summary["tokens_per_s"] > 0
    with pytest.raises(SystemExit):
        load_test.parse_args(["--base-url", "http://example.com/v1"])
