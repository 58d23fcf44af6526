"""Shared measurement and reporting for benchmark subcommands.

Every figure is a ratio against a baseline measured in the same run: warm-up, N repeats, median.
Results go to ``benchmarks/results/<name>.json`` and ``<name>.md`` (and ``<name>.png`` when plotted).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

RESULTS_DIR = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def setup_threads(threads: int) -> None:
    """Pin torch's intra-op threads; on 2-core machines oversubscription costs ~10x."""
    torch.set_num_threads(threads)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


@dataclass
class Timing:
    median_s: float
    samples_s: list[float]

    @property
    def spread(self) -> float:
        """(max - min) / median: how noisy the repeats were."""
        return (max(self.samples_s) - min(self.samples_s)) / self.median_s if self.median_s else 0.0


def measure(fn: Callable[[], object], warmup: int = 1, repeats: int = 3) -> Timing:
    """Median wall-clock seconds of ``fn()`` after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return Timing(statistics.median(samples), samples)


def load_average() -> float:
    """The 1-minute load average (the figure each benchmark records before and after a run)."""
    return os.getloadavg()[0]


def load_averages() -> str:
    """The 1-, 5- and 15-minute load averages as one string, e.g. ``"0.41 0.63 0.80"``."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def wait_until_quiet(max_load: float, wait: float) -> float:
    """Wait (up to ``wait`` seconds) for the 1-minute load average to fall below ``max_load``; returns the load."""
    deadline = time.monotonic() + wait
    while load_average() >= max_load and time.monotonic() < deadline:
        print(f"    load {load_average():.2f} >= {max_load}: waiting", flush=True)
        time.sleep(10)
    return load_average()


def environment() -> dict:
    import transformers

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


@dataclass
class Report:
    """Rows of one benchmark, written as JSON + a markdown table."""

    name: str
    title: str
    columns: Sequence[str]
    rows: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    settings: dict = field(default_factory=dict)

    def add(self, **row) -> None:
        self.rows.append(row)
        print("  " + "  ".join(f"{k}={_fmt(v)}" for k, v in row.items()), flush=True)

    def markdown(self) -> str:
        lines = [f"## {self.title}", ""]
        lines += [f"- {note}" for note in self.notes]
        if self.notes:
            lines.append("")
        lines.append("| " + " | ".join(self.columns) + " |")
        lines.append("|" + "---|" * len(self.columns))
        for row in self.rows:
            lines.append("| " + " | ".join(_fmt(row.get(c, "")) for c in self.columns) + " |")
        env = environment()
        lines += ["", f"Settings: `{json.dumps(self.settings)}`", "",
                  f"Environment: torch {env['torch']}, transformers {env['transformers']}, "
                  f"{env['cpu_count']} CPUs, {env['torch_threads']} torch threads, {env['date']}."]
        return "\n".join(lines) + "\n"

    def write(self, out_dir: Path = RESULTS_DIR) -> Path:
        out_dir.mkdir(parents=True, exist_ok=True)
        payload = {"name": self.name, "title": self.title, "settings": self.settings, "notes": self.notes,
                   "environment": environment(), "rows": self.rows}
        (out_dir / f"{self.name}.json").write_text(json.dumps(payload, indent=2, default=str))
        path = out_dir / f"{self.name}.md"
        path.write_text(self.markdown())
        print(f"wrote {path} and {path.with_suffix('.json')}")
        return path


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    if isinstance(value, int) and abs(value) >= 10000:
        return f"{value:,}"
    return str(value)


def save_plot(name: str, draw: Callable, out_dir: Path = RESULTS_DIR) -> Path | None:
    """Call ``draw(fig)`` and save ``<name>.png``; skipped with a message when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed (pip install 'hf-kvspec[bench]'); skipping the plot")
        return None
    fig = plt.figure(figsize=(8, 4.5))
    draw(fig)
    fig.tight_layout()
    path = out_dir / f"{name}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")
    return path
