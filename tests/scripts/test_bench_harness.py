"""The shared pieces of ``scripts/bench``: the load-average gate every benchmark records beside its figures."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parent.parent.parent / "scripts"


@pytest.fixture(scope="module")
def harness():
    sys.path.insert(0, str(SCRIPTS))
    from bench import harness

    return harness


def test_wait_until_quiet_waits_for_the_load_to_fall(harness, monkeypatch):
    loads, sleeps = iter([3.0, 3.0, 2.0, 2.0, 1.0, 1.0]), []
    monkeypatch.setattr(harness.os, "getloadavg", lambda: (next(loads), 0.0, 0.0))
    monkeypatch.setattr(harness.time, "sleep", sleeps.append)
    assert harness.wait_until_quiet(1.5, wait=100) == 1.0 and sleeps == [10, 10]
    monkeypatch.setattr(harness.os, "getloadavg", lambda: (9.0, 0.0, 0.0))
    assert harness.wait_until_quiet(1.5, wait=0) == 9.0  # no wait left: the load seen is recorded


def test_load_averages_reads_all_three(harness, monkeypatch):
    monkeypatch.setattr(harness.os, "getloadavg", lambda: (0.414, 1.0, 12.345))
    assert harness.load_averages() == "0.41 1.00 12.35" and harness.load_average() == 0.414
