"""Shared fixtures. Tests run on CPU with one thread (2-core machines: oversubscription costs 10x)."""

from __future__ import annotations

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def bundled():
    """``(model, tokenizer)`` of the bundled SmolLM2-135M-Instruct, converted once per machine."""
    from hf_kvspec import load_bundled_model

    return load_bundled_model()
