"""What the server tests share: a tiny word-level tokenizer built offline, a server started on 127.0.0.1 in a
background thread (a real uvicorn on a real socket), and the plain-``generate`` references."""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import threading
import time

import torch
import uvicorn
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from hf_kvspec.serving.server import ServerConfig, create_app

CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}assistant{% endif %}")


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """Word-level over the tiny configs' 96 ids: ``"t7 t17"`` <-> ``[7, 17]``; 0/1/2 are pad/bos/eos, 3/4/5 the
    chat roles."""
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "system": 3, "user": 4, "assistant": 5,
             **{f"t{i}": i for i in range(6, 96)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                        pad_token="<pad>")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def greedy_ids(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), do_sample=False, max_new_tokens=max_new_tokens)
    return out[0, len(prompt_ids):].tolist()


class RunningServer:
    """A uvicorn server for ``engine`` on a free loopback port, in a daemon thread."""

    def __init__(self, engine, config: ServerConfig | None = None):
        self.engine = engine
        self.app = create_app(engine, config or ServerConfig(model_name="tiny"))
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    @property
    def state(self):
        return self.app.state.server

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def __enter__(self) -> RunningServer:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()

    def client(self):
        import openai

        return openai.OpenAI(base_url=self.base_url, api_key="unused", max_retries=0, timeout=60)

    def raw(self, method: str, path: str, body: bytes | str | None = None) -> tuple[int, dict, bytes]:
        """A plain HTTP call (for bodies the openai client would never send); returns status, headers, body."""
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        try:
            connection.request(method, path, body=body, headers={"Content-Type": "application/json"})
            response = connection.getresponse()
            return response.status, dict(response.getheaders()), response.read()
        finally:
            connection.close()

    def metrics(self) -> dict[str, float]:
        """``/metrics`` as ``{sample name with labels: value}``."""
        status, _, body = self.raw("GET", "/metrics")
        assert status == 200
        samples = {}
        for line in body.decode().splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                samples[name] = float(value)
        return samples

    def wait_idle(self, timeout: float = 30.0) -> None:
        """Until no choice is open and the engine holds no request (the pool is then full again)."""
        deadline = time.monotonic() + timeout
        worker = self.state.worker  # its telemetry is taken between rounds: safe to read from this thread
        while worker.open_choices or worker.telemetry["running"] or worker.telemetry["waiting"] \
                or worker.telemetry["used_blocks"]:
            if time.monotonic() > deadline:
                raise AssertionError("the server did not go idle")
            time.sleep(0.02)


def error_of(err) -> dict:
    """The OpenAI error object of an ``openai.APIStatusError`` (or of a raw body)."""
    body = err if isinstance(err, (bytes, str)) else err.response.content
    return json.loads(body)["error"]


@contextlib.contextmanager
def no_leaks(server: RunningServer):
    """Asserts the block pool is full again once the server is idle after the block."""
    yield
    server.wait_idle()
    cache = server.engine.cache
    assert cache.num_free_blocks() == cache.num_total_blocks()
    assert all(cache.pool.ref_count(b) == 0 for b in range(cache.num_total_blocks()))
