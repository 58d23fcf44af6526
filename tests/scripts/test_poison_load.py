"""The poisoned load test (``scripts/poison_load_test.py``, issue 40) on a tiny model: honest streaming clients
beside bad ids, underflowing temperatures and raising processors; every honest output exact, every poisoned
request its own outcome, the pool back to full."""

from __future__ import annotations

import sys
from pathlib import Path

from hf_kvspec.serving.engine import Engine
from tests.serving.server_harness import tiny_tokenizer
from tests.tiny_models import tiny_model

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import poison_load_test


def test_poisoned_requests_fail_alone_beside_honest_streams():
    model = tiny_model("llama")
    engine = Engine(model, tiny_tokenizer(), kv_budget=128, block_size=4, max_tokens_per_round=32, max_running=8)
    args = poison_load_test.parse_args(["--honest", "12", "--poison-fraction", "0.2", "--max-tokens", "6",
                                        "--max-seconds", "120"])
    prompts = ["t7 t8 t9", "t40 t41", "t12 t13 t14 t15 t16", "t90 t33"]
    summary = poison_load_test.run(engine, model, prompts, args)
    assert poison_load_test.passed(summary), summary
    assert summary["honest"] == 12 and summary["poisoned"] == 3
    assert summary["bad_ids"] == summary["underflowing"] == summary["raising_processor"] == 1


def test_the_poison_plan_is_the_asked_fraction():
    assert len(poison_load_test.plan(32, 0.1)) == 4  # 4 of 36 requests: 11%, the nearest above 10%
    assert set(poison_load_test.plan(32, 0.1)) == set(poison_load_test.POISONS)
