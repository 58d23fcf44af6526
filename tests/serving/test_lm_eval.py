"""The real lm-evaluation-harness against ``hf-kvspec serve``: a small local task (YAML and JSONL written here, no
Hub) scored through the server with ``local-completions`` (log-likelihoods by ``echo`` and ``logprobs``, and
``generate_until``) gives the same per-request results as lm-evaluation-harness's own ``hf`` model on the same
weights: log-likelihoods within 1e-4, the same greedy flags and generations; ``local-chat-completions``
(generation with the chat template) gives the same generations as the ``hf`` model with the chat template.

Slow (the bundled model, two evaluations); needs the ``eval`` extra (``pip install -e ".[eval]"``)."""

from __future__ import annotations

import json
import os

import pytest

# no Hub here: the task's data are local files, the tokenizer and weights the bundled model's folder
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
lm_eval = pytest.importorskip("lm_eval")

from hf_kvspec.models import bundled_model_path, load_bundled_model  # noqa: E402
from hf_kvspec.serving.engine import Engine  # noqa: E402
from hf_kvspec.serving.server import ServerConfig  # noqa: E402

from .server_harness import RunningServer  # noqa: E402

QUESTIONS = [  # lm-evaluation-harness puts its target delimiter, a space, between question and choice
    ("The capital of France is", ["Paris", "London", "Berlin"], 0),
    ("Two plus two equals", ["five", "four", "three"], 1),
    ("The opposite of hot is", ["cold", "warm", "blue"], 0),
    ("Water freezes at zero degrees", ["Celsius", "Fahrenheit", "Kelvin"], 0),
]


def _task_folder(tmp_path) -> str:
    """Two tasks over one local JSONL file: multiple choice (log-likelihoods) and generation (greedy until a
    newline)."""
    data = tmp_path / "questions.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in QUESTIONS))
    common = (f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
              "doc_to_text: \"{{question}}\"\n")
    (tmp_path / "kvspec_choice.yaml").write_text(
        "task: kvspec_choice\n" + common + "output_type: multiple_choice\ndoc_to_choice: \"{{choices}}\"\n"
        "doc_to_target: \"{{answer}}\"\nmetric_list:\n  - metric: acc\n")
    (tmp_path / "kvspec_generate.yaml").write_text(
        "task: kvspec_generate\n" + common + "output_type: generate_until\ndoc_to_target: \"{{choices[answer]}}\"\n"
        "generation_kwargs:\n  until: [\"\\n\", \".\"]\n  max_gen_toks: 12\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n")
    return str(tmp_path)


def _responses(results: dict) -> dict[str, list]:
    """Per task, each request's raw response in document and request order (``resps`` holds one list per request,
    of its repeats: one here)."""
    out = {}
    for task, samples in results["samples"].items():
        ordered = sorted(samples, key=lambda s: s["doc_id"])
        out[task] = [repeats[0] for sample in ordered for repeats in sample["resps"]]
    return out


@pytest.mark.slow
def test_lm_eval_through_the_server_equals_its_own_hf_model(tmp_path):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    folder = bundled_model_path()
    tasks, manager = ["kvspec_choice", "kvspec_generate"], TaskManager(include_path=_task_folder(tmp_path))
    model, tokenizer = load_bundled_model()
    engine = Engine(model, tokenizer, kv_budget="64MB", max_running=4)
    with RunningServer(engine, ServerConfig(model_name="smollm2")) as server:
        served = simple_evaluate(
            model="local-completions", tasks=tasks, task_manager=manager, log_samples=True,
            model_args={"model": "smollm2", "base_url": f"{server.base_url}/completions", "num_concurrent": 1,
                        "max_retries": 1, "tokenizer_backend": "huggingface", "tokenizer": str(folder)})
        chat = simple_evaluate(  # local-chat-completions: generation through /v1/chat/completions
            model="local-chat-completions", tasks=["kvspec_generate"], task_manager=manager, log_samples=True,
            apply_chat_template=True,
            model_args={"model": "smollm2", "base_url": f"{server.base_url}/chat/completions", "num_concurrent": 1,
                        "max_retries": 1, "tokenizer_backend": "huggingface", "tokenizer": str(folder)})
    own = simple_evaluate(model="hf", model_args={"pretrained": str(folder), "dtype": "float32", "device": "cpu"},
                          tasks=tasks, task_manager=manager, log_samples=True, batch_size=1)
    own_chat = simple_evaluate(model="hf", model_args={"pretrained": str(folder), "dtype": "float32", "device": "cpu"},
                               tasks=["kvspec_generate"], task_manager=manager, log_samples=True, batch_size=1,
                               apply_chat_template=True)
    assert _responses(chat)["kvspec_generate"] == _responses(own_chat)["kvspec_generate"]
    ours, theirs = _responses(served), _responses(own)
    assert len(ours["kvspec_choice"]) == sum(len(c) for _, c, _ in QUESTIONS)
    assert any(greedy for _, greedy in theirs["kvspec_choice"])  # the flags can differ: some are True
    for (ll, greedy), (ll_ref, greedy_ref) in zip(ours["kvspec_choice"], theirs["kvspec_choice"]):
        assert float(ll) == pytest.approx(float(ll_ref), abs=1e-4) and bool(greedy) == bool(greedy_ref)
    assert ours["kvspec_generate"] == theirs["kvspec_generate"]
    assert served["results"]["kvspec_choice"]["acc,none"] == own["results"]["kvspec_choice"]["acc,none"]
