"""The speculative suite runs with the decode kernels and the fast forward on (the loop's defaults on CPU) for
every model they apply to, tiny ones included, so each greedy-identity and sampling test also checks the fast
paths; tests that pass ``decode_kernels=False`` / ``fast_forward=False`` check the reference paths. Kernel plans
stay in the process (no plan file)."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _route_tiny_layers(monkeypatch):
    from hf_kvspec.kernels import linear

    monkeypatch.setattr(linear, "MIN_WEIGHT_ELEMENTS", 0)
    monkeypatch.setattr(linear, "default_plans_file", lambda: None)  # tests never write the user's cache


@pytest.fixture(autouse=True)
def _fast_forward_tiny_models(monkeypatch):
    from hf_kvspec.forward import runner

    monkeypatch.setattr(runner, "MIN_LINEAR_ELEMENTS", 0)
