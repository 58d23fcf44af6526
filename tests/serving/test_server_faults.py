"""``hf-kvspec serve`` under trouble: bad bodies (400 naming the field), a full queue (429 + Retry-After), a
client that disconnects (its request cancelled, its blocks freed), a round that raises (500 for that round's
requests only, the server keeps serving) and SIGTERM with requests in flight (they finish, new ones are
refused, the process exits 0)."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import openai
import pytest

from hf_kvspec.serving.engine import Engine
from hf_kvspec.serving.server import ServerConfig
from tests.tiny_models import tiny_model

from .server_harness import RunningServer, error_of, greedy_ids, no_leaks, tiny_tokenizer

PROMPT = "t7 t19 t33 t41 t8 t60 t12 t77 t20"
POISON = 95  # a prompt holding this id gets a logits processor that raises
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model():
    """The tiny model without an EOS id, so every output runs to max_tokens (long streams stay long)."""
    model = tiny_model("llama")
    model.generation_config.eos_token_id = None
    return model


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


class Boom(RuntimeError):
    pass


def explode(input_ids, scores):
    raise Boom("a logits processor raised")


class PoisonEngine(Engine):
    """The engine, with a raising logits processor added to requests whose prompt holds ``POISON``."""

    def add_request(self, prompt, **kwargs):
        if POISON in prompt:
            kwargs["logits_processor"] = [explode]
        return super().add_request(prompt, **kwargs)


def serve(model, tokenizer, engine_class=Engine, max_running: int = 8, **config) -> RunningServer:
    engine = engine_class(model, tokenizer, kv_budget=100, block_size=4, max_tokens_per_round=32,
                          max_running=max_running)
    return RunningServer(engine, ServerConfig(model_name="tiny", **config))


@pytest.fixture(scope="module")
def server(model, tokenizer):
    with serve(model, tokenizer) as running:
        yield running


BAD_BODIES = [
    (b"{not json", None, "invalid_json"),
    (b"[1, 2]", None, "invalid_json"),
    ({"prompt": "t7", "max_tokens": 0}, "max_tokens", "invalid_value"),
    ({"prompt": "t7", "max_tokens": -3}, "max_tokens", "invalid_value"),
    ({"prompt": "t7", "max_tokens": "ten"}, "max_tokens", "invalid_value"),
    ({"prompt": "t7", "max_tokens": 2.5}, "max_tokens", "invalid_value"),
    ({"prompt": "t7", "temperature": "hot"}, "temperature", "invalid_value"),
    ({"prompt": "t7", "temperature": 3}, "temperature", "invalid_value"),
    ({"prompt": "t7", "top_p": 0}, "top_p", "invalid_value"),
    ({"prompt": "t7", "n": 0}, "n", "invalid_value"),
    ({"prompt": "t7", "n": True}, "n", "invalid_value"),
    ({"prompt": "t7", "seed": "1"}, "seed", "invalid_value"),
    ({"prompt": "t7", "seed": 2**64}, "seed", "invalid_value"),
    ({"prompt": "t7", "seed": -1}, "seed", "invalid_value"),
    ({"prompt": "t7", "stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage",
     "invalid_value"),
    ({"prompt": [7, 500]}, "prompt", "invalid_value"),
    ({"prompt": [7, 96]}, "prompt", "invalid_value"),
    ({"prompt": "t7", "stop": 5}, "stop", "invalid_value"),
    ({"prompt": "t7", "stop": ["a", "b", "c", "d", "e"]}, "stop", "invalid_value"),
    ({"prompt": "t7", "stream": "yes"}, "stream", "invalid_value"),
    ({"prompt": "t7", "stream_options": {"include_usage": True}}, "stream_options", "invalid_value"),
    ({"prompt": "t7", "best_of": 2}, "best_of", "unsupported_parameter"),
    ({"prompt": "t7", "logprobs": 21}, "logprobs", "invalid_value"),
    ({"prompt": "t7", "frobnicate": 1}, "frobnicate", "unsupported_parameter"),
    ({"max_tokens": 4}, "prompt", "missing_required_parameter"),
    ({"prompt": ""}, "prompt", "invalid_value"),
    ({"prompt": ["t7", 5]}, "prompt", "invalid_value"),
    ({"prompt": ["t7"] * 65}, "prompt", "invalid_value"),
    ({"prompt": ["t7", ""]}, "prompt", "invalid_value"),
    ({"prompt": [7, -1]}, "prompt", "invalid_value"),
]
BAD_CHATS = [
    ({"messages": "hello"}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": [{"content": "t7"}]}, "messages[0]"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "t7"}], "max_completion_tokens": 0}, "max_completion_tokens"),
    ({"messages": [{"role": "wizard", "content": "t7"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": "t7"}], "max_tokens": -1, "max_completion_tokens": 4}, "max_tokens"),
]


@pytest.mark.parametrize(("body", "param", "code"), BAD_BODIES)
def test_a_bad_completion_body_is_a_400_naming_the_field(server, body, param, code):
    raw = body if isinstance(body, bytes) else json.dumps(body)
    status, _, reply = server.raw("POST", "/v1/completions", raw)
    error = error_of(reply)
    assert status == 400
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", param, code)
    assert param is None or repr(param) in error["message"] or param in error["message"]


@pytest.mark.parametrize(("body", "param"), BAD_CHATS)
def test_a_bad_chat_body_is_a_400_naming_the_field(server, body, param):
    status, _, reply = server.raw("POST", "/v1/chat/completions", json.dumps(body))
    assert status == 400 and error_of(reply)["param"] == param


def test_prompts_longer_than_the_model_or_the_kv_budget_are_400s(server):
    client = server.client()
    cases = [(" ".join(["t9"] * 600), 1, "prompt"),  # past max_position_embeddings=512
             ("t9 t10", 600, "max_tokens"),  # the prompt fits the model, not with 600 new tokens
             (list(range(6, 96)) * 5, 1, "prompt"),  # 450 ids: within the positions, past the 400 KV slots
             (" ".join(["t9"] * 300), 150, "max_tokens")]  # 300 + 150 - 1 KV slots > 400
    for prompt, max_tokens, param in cases:
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens)
        error = error_of(caught.value)
        assert (error["param"], error["code"]) == (param, "context_length_exceeded")
    status, _, reply = server.raw("POST", "/v1/chat/completions", json.dumps(
        {"messages": [{"role": "user", "content": " ".join(["t9"] * 600)}]}))
    assert status == 400 and error_of(reply)["param"] == "messages"
    assert not server.engine.has_unfinished()


def test_a_full_queue_is_a_429_with_retry_after(model, tokenizer):
    with serve(model, tokenizer, max_queue=2, retry_after_s=3) as server, no_leaks(server):
        stream = server.client().completions.create(model="tiny", prompt=PROMPT, max_tokens=150, n=2,
                                                    temperature=0, stream=True)
        next(iter(stream))
        status, headers, reply = server.raw("POST", "/v1/completions", json.dumps({"prompt": "t7"}))
        assert status == 429 and headers["retry-after"] == "3"
        assert error_of(reply)["type"] == "rate_limit_exceeded"
        with pytest.raises(openai.RateLimitError):
            server.client().chat.completions.create(model="tiny", messages=[{"role": "user", "content": "t7"}])
        stream.close()


def test_a_disconnect_mid_stream_cancels_the_request_and_frees_its_blocks(server, model, tokenizer):
    before = server.metrics()['kvspec_requests_total{outcome="cancelled"}']
    with no_leaks(server):
        stream = server.client().completions.create(model="tiny", prompt=PROMPT, max_tokens=300, temperature=0,
                                                    stream=True)
        chunks = iter(stream)
        next(chunks), next(chunks)
        assert server.engine.has_unfinished()
        stream.close()
    assert server.metrics()['kvspec_requests_total{outcome="cancelled"}'] == before + 1
    # and the server still answers exactly
    response = server.client().completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0)
    assert response.kvspec["choices"][0]["token_ids"] == greedy_ids(model, tokenizer(PROMPT)["input_ids"], 6)


def test_a_disconnect_while_waiting_for_a_whole_response_cancels_it(server):
    before = server.metrics()['kvspec_requests_total{outcome="cancelled"}']
    with no_leaks(server):
        connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        connection.request("POST", "/v1/completions", json.dumps({"prompt": PROMPT, "max_tokens": 300}),
                           headers={"Content-Type": "application/json"})
        deadline = time.monotonic() + 10
        while not server.engine.has_unfinished() and time.monotonic() < deadline:
            time.sleep(0.01)
        connection.sock.shutdown(socket.SHUT_RDWR)
        connection.close()
    assert server.metrics()['kvspec_requests_total{outcome="cancelled"}'] == before + 1


def test_a_round_that_raises_fails_only_its_requests_and_the_server_carries_on(model, tokenizer):
    """max_running=1: the poisoned request runs in rounds of its own; the one before and after it are exact."""
    with serve(model, tokenizer, PoisonEngine, max_running=1) as server, no_leaks(server):
        client = server.client()
        results = {}

        def call(name, prompt, max_tokens):
            try:
                response = client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens,
                                                     temperature=0)
                results[name] = response.kvspec["choices"][0]["token_ids"]
            except openai.APIStatusError as err:
                results[name] = err

        before = threading.Thread(target=call, args=("before", PROMPT, 40))
        before.start()
        while not server.engine.has_unfinished():
            time.sleep(0.005)
        poisoned = threading.Thread(target=call, args=("poisoned", f"t7 t{POISON} t9", 5))
        poisoned.start()
        before.join()
        poisoned.join()
        call("after", "t30 t31 t32", 7)
        with pytest.raises(openai.InternalServerError):  # a stream failing before its first token: still a 500
            client.completions.create(model="tiny", prompt=f"t{POISON}", max_tokens=5, stream=True)
        failed = server.metrics()['kvspec_requests_total{outcome="failed"}']
    assert failed == 2
    failure = results["poisoned"]
    assert isinstance(failure, openai.InternalServerError)
    assert (error_of(failure)["type"], error_of(failure)["code"]) == ("server_error", "round_failed")
    assert "Boom" in error_of(failure)["message"]
    assert results["before"] == greedy_ids(model, tokenizer(PROMPT)["input_ids"], 40)
    assert results["after"] == greedy_ids(model, [30, 31, 32], 7)


SERVER_SCRIPT = """
import sys, time
sys.path.insert(0, {repo!r})
from hf_kvspec.serving.engine import Engine
from hf_kvspec.serving.server import ServerConfig, run_server
from tests.serving.server_harness import tiny_tokenizer
from tests.tiny_models import tiny_model

class SlowEngine(Engine):  # 20 ms a round, so requests are surely in flight when SIGTERM comes
    def step(self):
        time.sleep(0.02)
        return super().step()

model = tiny_model("llama")
model.generation_config.eos_token_id = None
engine = SlowEngine(model, tiny_tokenizer(), kv_budget=256, block_size=4)
run_server(engine, ServerConfig(model_name="tiny"), port={port}, log_level="warning")
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_healthy(port: int, process, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, process.communicate()[1]
        try:
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
            connection.request("GET", "/health")
            if connection.getresponse().status == 200:
                return
        except OSError:
            time.sleep(0.1)
    raise AssertionError("the server process did not come up")


def test_sigterm_drains_requests_in_flight_refuses_new_ones_and_exits(model, tokenizer, tmp_path):
    port = free_port()
    script = tmp_path / "serve.py"
    script.write_text(SERVER_SCRIPT.format(repo=str(REPO), port=port))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen([sys.executable, str(script)], env=env, stderr=subprocess.PIPE, text=True)
    try:
        wait_healthy(port, process)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        started, texts = threading.Barrier(3), {}

        def stream(name: str, prompt: str) -> None:
            chunks = iter(client.completions.create(model="tiny", prompt=prompt, max_tokens=40, temperature=0,
                                                    stream=True))
            first = next(chunks)
            started.wait()
            rest = list(chunks)
            texts[name] = ("".join(c.choices[0].text for c in [first, *rest]), rest[-1].choices[0].finish_reason)

        threads = [threading.Thread(target=stream, args=(name, prompt)) for name, prompt in
                   (("a", PROMPT), ("b", "t40 t41 t42"))]
        for thread in threads:
            thread.start()
        started.wait(timeout=60)
        process.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        with pytest.raises(OSError):  # the listening socket is closed: a new request cannot connect
            http.client.HTTPConnection("127.0.0.1", port, timeout=2).request("GET", "/health")
        for thread in threads:
            thread.join(timeout=60)
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    for name, prompt in (("a", tokenizer(PROMPT)["input_ids"]), ("b", [40, 41, 42])):
        reference = greedy_ids(model, prompt, 40)
        assert texts[name] == (tokenizer.decode(reference), "length")


def test_unknown_paths_and_methods_get_openai_error_bodies(server):
    status, _, reply = server.raw("GET", "/v1/nothing")
    assert status == 404 and error_of(reply)["code"] == "unknown_url" and "/v1/nothing" in error_of(reply)["message"]
    status, _, reply = server.raw("GET", "/v1/completions")
    assert status == 405 and error_of(reply)["code"] == "method_not_allowed"
    assert error_of(reply)["type"] == "invalid_request_error"


def test_a_body_over_the_limit_is_a_413(model, tokenizer):
    with serve(model, tokenizer, max_body_bytes=1000) as small:
        status, _, reply = small.raw("POST", "/v1/completions", json.dumps({"prompt": "t7 " * 400, "max_tokens": 1}))
        assert status == 413 and error_of(reply)["code"] == "request_too_large"
        status, _, reply = small.raw("POST", "/v1/completions", json.dumps({"prompt": "t7 t8", "max_tokens": 2}))
        assert status == 200
    with pytest.raises(ValueError, match="max_body_bytes"):
        ServerConfig(max_body_bytes=0)


def test_seed_forks_wrap_instead_of_overflowing(server):
    """``seed: 2**64 - 1`` with ``n: 2``: choice 1's seed wraps to 0 (it overflowed torch's seed range)."""
    body = {"prompt": "t7 t8 t9", "max_tokens": 4, "temperature": 1.0, "seed": 2**64 - 1, "n": 2}
    status, _, reply = server.raw("POST", "/v1/completions", json.dumps(body))
    assert status == 200 and len(json.loads(reply)["choices"]) == 2
    alone = {"prompt": "t7 t8 t9", "max_tokens": 4, "temperature": 1.0, "seed": 0}
    status, _, single = server.raw("POST", "/v1/completions", json.dumps(alone))
    assert json.loads(reply)["choices"][1]["text"] == json.loads(single)["choices"][0]["text"]


def test_an_underflowing_temperature_is_greedy_and_harms_no_other_stream(server, model, tokenizer):
    """Issue 40: ``temperature: 1e-40`` made NaN probabilities and failed every stream in its round."""
    client = server.client()
    with no_leaks(server):
        stream = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, stream=True)
        first = next(iter(stream))
        tiny = client.completions.create(model="tiny", prompt="t7 t8", max_tokens=5, temperature=1e-40)
        text = first.choices[0].text + "".join(chunk.choices[0].text for chunk in stream)
    assert tiny.kvspec["choices"][0]["token_ids"] == greedy_ids(model, [7, 8], 5)
    assert text == tokenizer.decode(greedy_ids(model, tokenizer(PROMPT)["input_ids"], 12))
