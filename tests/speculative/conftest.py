"""The speculative suite runs with the decode kernels on (the loop's default on CPU) for every layer, tiny ones
included, so each greedy-identity and sampling test also checks the fast path; tests that pass
``decode_kernels=False`` check the stock reference path. Kernel plans stay in the process (no plan file)."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _route_tiny_layers(monkeypatch):
    from hf_kvspec.kernels import linear

    monkeypatch.setattr(linear, "MIN_WEIGHT_ELEMENTS", 0)
    monkeypatch.setattr(linear, "default_plans_file", lambda: None)  # tests never write the user's cache
