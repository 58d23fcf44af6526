"""The package's measurements as ``evaluate`` metric modules, loadable offline from the installed package.

Boundary: locates and loads the metric scripts that live next to this file; the scripts themselves import nothing
from hf_kvspec (``evaluate.load`` copies a script into its module cache and imports the copy), and nothing here runs
a model.

    draft_acceptance   per-depth top-1 agreement of a draft head with its target, chain (and tree) tau
    cache_fidelity     perplexity through a lossy KV cache vs full precision, KL, top-1 agreement

``load_metric(name, **kwargs)`` is ``evaluate.load(<path of the script>, **kwargs)``: a local path, so evaluate
never contacts the Hub, and every ``evaluate.load`` option (``config_name``, ``num_process``/``process_id``/
``experiment_id`` for distributed evaluation, ``keep_in_memory``, ``cache_dir``) works as usual.
"""

from __future__ import annotations

from pathlib import Path

from hf_kvspec.metrics.cache_fidelity import token_statistics

METRICS_DIR = Path(__file__).parent
METRIC_NAMES = ("draft_acceptance", "cache_fidelity")

__all__ = ["METRIC_NAMES", "load_metric", "metric_path", "token_statistics"]


def metric_path(name: str) -> Path:
    """The script ``evaluate.load`` takes for ``name``."""
    if name not in METRIC_NAMES:
        raise ValueError(f"Unknown hf_kvspec metric {name!r}; choose one of {', '.join(METRIC_NAMES)}.")
    return METRICS_DIR / f"{name}.py"


def load_metric(name: str, config_name: str | None = None, **kwargs):
    """``evaluate.load`` of one of ``METRIC_NAMES`` from this package (no network)."""
    import evaluate

    return evaluate.load(str(metric_path(name)), config_name, **kwargs)
