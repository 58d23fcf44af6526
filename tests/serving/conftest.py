"""The engine suite runs its rounds on the fast forward (the engine's default on CPU) for every model it applies
to, tiny ones included, so each exactness test also checks the fast path; tests that pass ``reference=True`` or
``fast_forward=False`` check the model's own forward."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _fast_forward_tiny_models(monkeypatch):
    from hf_kvspec.forward import runner

    monkeypatch.setattr(runner, "MIN_LINEAR_ELEMENTS", 0)
