"""The benchmark's side of the peer protocol: start ``peer_worker.py`` under a peer's interpreter and call it.

Boundary: processes and pipes only; which interpreter and which model file come from ``peer_envs.py``, and the
protocol itself is written down in ``peer_worker.py``'s docstring.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

WORKER = Path(__file__).resolve().with_name("peer_worker.py")


class PeerError(RuntimeError):
    """A peer worker failed a request or died; the message names the peer."""


@dataclass
class Generation:
    """One greedy answer: the new tokens before the first EOS, whether an EOS ended it, and its timings."""

    tokens: list[int]
    eos: bool
    ttft_s: float
    seconds: float

    @property
    def count(self) -> int:
        """Generated tokens, the EOS included (what every system spent a step on)."""
        return len(self.tokens) + int(self.eos)


class PeerProcess:
    """A worker process holding one loaded peer. ``threads`` also sets ``OMP_NUM_THREADS`` of the process."""

    def __init__(self, name: str, python: str | Path, backend: str, model: str | Path, threads: int,
                 options: dict | None = None):
        self.name = name
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1")
        env.pop("PYTHONPATH", None)  # the peer's interpreter sees its own packages only
        # stderr is inherited: a peer's warnings reach the terminal
        self.process = subprocess.Popen([str(python), str(WORKER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        text=True, env=env)
        self.info = self.call({"op": "load", "backend": backend, "model": str(model), "threads": threads,
                               "options": options or {}})["info"]

    def call(self, request: dict) -> dict:
        try:
            self.process.stdin.write(json.dumps(request) + "\n")
            self.process.stdin.flush()
            line = self.process.stdout.readline()
        except BrokenPipeError:
            line = ""
        if not line:
            code = self.process.wait()
            raise PeerError(f"peer {self.name}: the worker exited (code {code}) on {request['op']}; its stderr "
                            "is above")
        reply = json.loads(line)
        if not reply["ok"]:
            raise PeerError(f"peer {self.name}: {reply['error']}")
        return reply

    def generate(self, ids: list[int], max_new_tokens: int, eos: list[int]) -> Generation:
        reply = self.call({"op": "generate", "ids": ids, "max_new_tokens": max_new_tokens, "eos": eos})
        return Generation(reply["tokens"], reply["eos"], reply["ttft_s"], reply["seconds"])

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def __enter__(self) -> PeerProcess:
        return self

    def __exit__(self, *_) -> None:
        self.close()
