"""``scripts/benchmark.py step``'s pure parts: the c_v interpolation the bound uses, the op categories of the
profile (the packed projections counted as linear), and that the profile's recording of projections is undone."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.tiny_models import tiny_model

SCRIPTS = Path(__file__).resolve().parent.parent.parent / "scripts"


@pytest.fixture(scope="module")
def step():
    sys.path.insert(0, str(SCRIPTS))
    from bench import step

    return step


def test_c_v_interpolates_between_measured_token_counts_and_extrapolates_linearly(step):
    curve = {1: 1.0, 2: 1.2, 4: 1.4, 8: 2.0}
    assert step._interpolate(curve, 1) == 1.0
    assert step._interpolate(curve, 3) == pytest.approx(1.3)
    assert step._interpolate(curve, 6) == pytest.approx(1.7)
    assert step._interpolate(curve, 16) == pytest.approx(4.0)  # past the last point: proportional to T


def test_categories_count_packed_projections_as_linear(step):
    events = [SimpleNamespace(key=key, self_cpu_time_total=us) for key, us in
              [(step.LINEAR_EVENT, 2000.0), ("aten::mm", 1000.0), ("aten::cat", 300.0), ("aten::mul", 700.0)]]
    split = step._categories(events, calls=2)  # microseconds over 2 forwards -> ms per forward
    assert split["linear"] == pytest.approx(1.5) and split["KV append (cat)"] == pytest.approx(0.15)
    assert split["small ops"] == pytest.approx(0.35) and split["attention"] == 0


def test_recording_projections_is_undone(step):
    from hf_kvspec.forward import packed
    from hf_kvspec.forward.runner import FastForward

    before = packed.PanelLinear.__call__, packed.PackedLinear.__call__
    fast = FastForward(tiny_model("llama"))
    with torch.profiler.profile() as prof, step._projections_recorded():
        fast(dict(input_ids=torch.tensor([[4, 5]])), None)
    assert any(event.key == step.LINEAR_EVENT for event in prof.key_averages())
    assert (packed.PanelLinear.__call__, packed.PackedLinear.__call__) == before


def test_unknown_parts_are_refused(step):
    with pytest.raises(SystemExit, match="unknown"):
        step.run(SimpleNamespace(parts="profile,speed"))
