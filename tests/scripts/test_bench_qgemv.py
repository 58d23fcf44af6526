"""``scripts/benchmark.py qgemv``'s accuracy copies: the user's model is left as it was, every decoder linear of the
copy holds ``dequantize(quantize(w))``, and the head and embeddings each keep their own format."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from hf_kvspec.kernels.quantized import dequantize, quantize_int4, quantize_int8
from tests.tiny_models import tiny_model

SCRIPTS = Path(__file__).resolve().parent.parent.parent / "scripts"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(SCRIPTS))
    from bench import qgemv

    return qgemv


def _tied_model():
    model = tiny_model("llama", hidden_size=64, intermediate_size=128, tie_word_embeddings=True)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    return model


def test_copy_quantizes_the_body_and_leaves_the_model_alone(bench):
    model = _tied_model()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    copied = bench._quantized_copy(model, "int4-g32", "int8", None)
    assert all(torch.equal(before[name], p) for name, p in model.named_parameters())
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight  # still tied
    original = dict(model.named_modules())
    for name, module in copied.named_modules():
        if isinstance(module, nn.Linear) and module is not copied.get_output_embeddings():
            assert torch.equal(module.weight, dequantize(quantize_int4(original[name].weight, 32)))
    head, embed = copied.get_output_embeddings().weight, copied.get_input_embeddings().weight
    assert torch.equal(head, dequantize(quantize_int8(model.get_output_embeddings().weight)))
    assert torch.equal(embed, model.get_input_embeddings().weight)  # fp32, untied from the int8 head


def test_read_bytes_count_packed_formats(bench):
    model = _tied_model()
    fp32 = bench._read_bytes(model, None, None)
    assert fp32 == 4 * sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    assert bench._read_bytes(model, "int8", "int8") < fp32 / 3
