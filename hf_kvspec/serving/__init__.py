"""Continuous batching on unmodified transformers models: ``Engine`` (engine.py) schedules requests in rounds
(scheduler.py) over a ragged paged KV cache (``hf_kvspec.cache.ragged``), one packed forward per round
(runner.py, attention.py). Public names are re-exported from ``hf_kvspec``.
"""
