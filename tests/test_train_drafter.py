"""scripts/train_drafter.py end to end on a tiny random base model: under a real ``accelerate launch``, the loss
falls; a run killed from outside (SIGKILL) after a checkpoint and resumed ends with exactly the parameters of an
uninterrupted run."""

from __future__ import annotations

import itertools
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import hf_kvspec
from tests.heads.tiny_base import save_tiny_base, write_tiny_corpus

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "train_drafter.py"


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("train_drafter")
    save_tiny_base(root / "base")
    write_tiny_corpus(root / "corpus.txt")
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("say one", "say two")))
    return root


def _args(root: Path, output: str, *extra: str) -> list[str]:
    return ["--head", "eagle", "--base_model", str(root / "base"), "--dataset", str(root / "corpus.txt"),
            str(root / "prompts.jsonl"), "--self_distill", "true", "--distill_max_new_tokens", "8",
            "--cache_features", "true", "--data_cache_dir", str(root / "cache"), "--label_source", "data",
            "--unroll_steps", "2", "--max_steps", "12", "--per_device_batch_size", "4",
            "--gradient_accumulation_steps", "2", "--learning_rate", "1e-2", "--warmup_steps", "2",
            "--logging_steps", "3", "--save_steps", "4", "--num_threads", "1", "--output_dir", str(root / output),
            *extra]


def _command(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1", "--num_machines", "1",
            "--mixed_precision", "no", "--dynamo_backend", "no", "--cpu", str(SCRIPT), *args]


_ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def _launch(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(_command(args), capture_output=True, text=True, env=_ENV, timeout=600)


def _launch_and_kill_after_checkpoint(args: list[str], output: Path, step: int) -> None:
    """Start a run and SIGKILL its whole process group once ``checkpoints/step-{step}`` is complete.

    Where the kill lands is made certain from outside: ``train_log.jsonl`` is created as a named pipe that nobody
    reads, so the run blocks when it opens it for its first log line (the caller makes that come after ``step`` and
    before the next checkpoint), and ``step-{step}`` is the only checkpoint at the kill whatever the machine's speed."""
    output.mkdir(parents=True)
    os.mkfifo(output / "train_log.jsonl")
    state = output / "checkpoints" / f"step-{step}" / "trainer_state.json"  # written last by save_checkpoint
    with open(output.parent / f"{output.name}.log", "w") as sink:
        process = subprocess.Popen(_command(args), stdout=sink, stderr=subprocess.STDOUT, env=_ENV,
                                   start_new_session=True)
        deadline = time.monotonic() + 600
        while not state.is_file() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        alive = process.poll() is None
        if alive:
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=60)
    assert alive and state.is_file(), (output.parent / f"{output.name}.log").read_text()[-3000:]
    assert [path.name for path in (output / "checkpoints").iterdir()] == [f"step-{step}"]
    (output / "train_log.jsonl").unlink()  # the resumed run logs to a plain file


def test_accelerate_launch_loss_falls_and_resume_is_exact(workspace):
    full = _launch(_args(workspace, "full"))
    assert full.returncode == 0, full.stderr[-3000:]
    log = [json.loads(line) for line in (workspace / "full" / "train_log.jsonl").read_text().splitlines()]
    losses = [row["loss"] for row in log]
    assert [row["step"] for row in log] == [3, 6, 9, 12]
    assert all(math.isfinite(x) for x in losses), losses
    assert all(later < earlier for earlier, later in itertools.pairwise(losses)), losses  # falls at every log line

    # logging every 6 steps (training is unchanged by it): the run blocks at step 6, after the step-4 checkpoint
    _launch_and_kill_after_checkpoint(_args(workspace, "resumed", "--logging_steps", "6"), workspace / "resumed",
                                      step=4)
    assert not (workspace / "resumed" / "model.safetensors").exists()
    resumed = _launch(_args(workspace, "resumed", "--logging_steps", "6", "--resume_from_checkpoint", "latest"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout + resumed.stderr

    commands = json.loads((workspace / "resumed" / "training_summary.json").read_text())["command"].splitlines()
    assert len(commands) == 2 and "--resume_from_checkpoint" not in commands[0] and "latest" in commands[1]

    expected = load_file(str(workspace / "full" / "model.safetensors"))
    found = load_file(str(workspace / "resumed" / "model.safetensors"))
    assert expected.keys() == found.keys()
    for name in expected:
        assert torch.equal(expected[name], found[name]), name


def test_yaml_config_medusa_online_features_card(workspace, tmp_path):
    """In-process run from a YAML file (CLI overrides it): online features, held-out card, Auto-loadable output."""
    sys.path.insert(0, str(SCRIPT.parent))
    import train_drafter

    config = tmp_path / "medusa.yaml"
    config.write_text(f"head: medusa\nbase_model: {workspace / 'base'}\ndataset: [{workspace / 'corpus.txt'}]\n"
                      f"num_heads: 2\nnum_layers: 2\nmax_steps: 100\nper_device_batch_size: 4\nlearning_rate: 0.01\n"
                      f"warmup_steps: 1\nnum_threads: 1\ndata_cache_dir: {workspace / 'cache'}\n"
                      f"eval_prompts: {workspace / 'prompts.jsonl'}\ndistill_max_new_tokens: 8\n")
    train_drafter.main(["--config", str(config), "--max_steps", "3", "--output_dir", str(tmp_path / "out"),
                        "--save_dtype", "float16"])
    assert {t.dtype for t in load_file(str(tmp_path / "out" / "model.safetensors")).values()} == {torch.float16}
    summary = json.loads((tmp_path / "out" / "training_summary.json").read_text())
    assert summary["args"]["max_steps"] == 3 and summary["args"]["num_layers"] == 2
    assert summary["held_out"]["prompts"] == 2 and len(summary["held_out"]["per_head_top1"]) == 2
    card = (tmp_path / "out" / "README.md").read_text()
    assert f"{100 * summary['held_out']['per_head_top1'][0]:.1f}%" in card
    assert f"τ = {summary['held_out']['tau']:.2f}" in card
    hf_kvspec.register()
    try:
        from transformers import AutoModel

        head = AutoModel.from_pretrained(tmp_path / "out")
        assert type(head).__name__ == "MedusaHeads" and len(head.heads[0].blocks) == 2
        assert head.config.base_model_name_or_path == str(workspace / "base")
    finally:
        hf_kvspec.unregister()


def test_time_cap_stops_early_then_saves_and_prepare_only_caches_held_out(workspace, tmp_path):
    """--max_train_seconds 0 stops after one step and still saves, evaluates and records where it stopped;
    --prepare_data_only also answers the held-out prompts, so a later run's evaluation generates nothing."""
    sys.path.insert(0, str(SCRIPT.parent))
    import train_drafter

    cache = tmp_path / "cache"
    common = ["--head", "medusa", "--base_model", str(workspace / "base"), "--dataset", str(workspace / "corpus.txt"),
              "--num_heads", "2", "--per_device_batch_size", "4", "--num_threads", "1", "--data_cache_dir",
              str(cache), "--eval_prompts", str(workspace / "prompts.jsonl"), "--self_distill", "true",
              "--distill_max_new_tokens", "4"]
    train_drafter.main([*common, "--prepare_data_only", "true"])
    cached = (cache / "self_distill.jsonl").read_text().splitlines()
    assert len(cached) == 2  # both held-out prompts answered during preparation

    train_drafter.main([*common, "--max_steps", "50", "--max_train_seconds", "0", "--save_steps", "20",
                       "--output_dir", str(tmp_path / "out")])
    summary = json.loads((tmp_path / "out" / "training_summary.json").read_text())
    assert summary["stopped_at_step"] == 1 and summary["args"]["max_steps"] == 50
    assert (tmp_path / "out" / "model.safetensors").is_file()
    assert (tmp_path / "out" / "checkpoints" / "step-1").is_dir()  # resumable from where the cap hit
    assert "after 1 of the 50 steps" in (tmp_path / "out" / "README.md").read_text()
    assert (cache / "self_distill.jsonl").read_text().splitlines() == cached  # evaluation reused the cache


@pytest.mark.parametrize("config", sorted((SCRIPT.parent / "train_configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_committed_config_parses(config):
    # a renamed flag or a bad choice in a committed recipe fails here, not after an hour of self-distillation
    sys.path.insert(0, str(SCRIPT.parent))
    import train_drafter

    model, data, train = train_drafter.parse_args(["--config", str(config)])
    assert model.head in ("medusa", "eagle", "early_exit") and data.dataset and train.output_dir.startswith("runs/")
    if model.init_from is not None:  # a fine-tuning recipe names a head that exists
        from hf_kvspec.heads.warm_start import resolve_source

        assert (resolve_source(model.init_from) / "model.safetensors").is_file()


def test_resume_weights_from_a_committed_head_continues_step_schedule_and_record(workspace, tmp_path, capsys):
    """A checkpoint's head/ folder (what a session commits) continues the run in a new process: the step, the
    learning-rate schedule and the run record carry on, the weights start where the folder left them; and
    --evaluate_only measures such a folder on the held-out prompts without training."""
    sys.path.insert(0, str(SCRIPT.parent))
    import train_drafter

    common = ["--head", "eagle", "--base_model", str(workspace / "base"), "--dataset", str(workspace / "corpus.txt"),
              "--label_source", "data", "--per_device_batch_size", "4", "--num_threads", "1", "--max_steps", "6",
              "--warmup_steps", "2", "--logging_steps", "1", "--save_steps", "3", "--save_dtype", "float16",
              "--data_cache_dir", str(workspace / "cache"), "--eval_prompts", str(workspace / "prompts.jsonl"),
              "--distill_max_new_tokens", "4"]
    train_drafter.main([*common, "--output_dir", str(tmp_path / "a")])
    folder = tmp_path / "a" / "checkpoints" / "step-3" / "head"
    state = json.loads((folder / "trainer_state.json").read_text())
    assert state["completed_steps"] == 3 and {t.dtype for t in load_file(folder / "model.safetensors").values()} \
        == {torch.float16}

    train_drafter.main([*common, "--resume_weights_from", str(folder), "--output_dir", str(tmp_path / "c")])
    first = [json.loads(line) for line in (tmp_path / "a" / "train_log.jsonl").read_text().splitlines()]
    resumed = [json.loads(line) for line in (tmp_path / "c" / "train_log.jsonl").read_text().splitlines()]
    assert [row["step"] for row in resumed] == [4, 5, 6]
    assert [row["lr"] for row in resumed] == [row["lr"] for row in first[3:]]  # the cosine goes on from step 3
    summary = json.loads((tmp_path / "c" / "training_summary.json").read_text())
    assert summary["train_seconds"] > state["train_seconds"] and len(summary["command"].splitlines()) == 2
    assert summary["initialised_from"] is None  # the first run started fresh; the resumed one is not a fine-tune
    assert summary["cpu_seconds"] > state["cpu_seconds"] > 0  # one thread: CPU seconds track the wall clock
    assert summary["cpu_seconds"] == pytest.approx(summary["train_seconds"], abs=1.0)

    train_drafter.main([*common, "--evaluate_only", str(folder)])
    measured = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert measured["step"] == 3 and measured["prompts"] == 2 and 1.0 <= measured["tau"] <= 5.0


def test_run_record_sums_cpu_seconds_over_sessions_and_drops_them_when_unknown():
    """CPU-hours on the card: wall seconds x threads per session, summed; unknown (None) once a session ran on an
    accelerator or an earlier state did not record them, rather than a guess."""
    sys.path.insert(0, str(SCRIPT.parent))
    import time

    import train_drafter

    def session(threads, earlier=None, seconds=10.0):
        record = train_drafter.RunRecord(commands=[], cpu_threads=threads)
        if earlier is not None:
            record.resume({"completed_steps": 5, **earlier})
        record.started = time.time() - seconds
        return record

    assert session(2).cpu_seconds == pytest.approx(20.0, abs=0.1)
    resumed = session(2, {"train_seconds": 100.0, "cpu_seconds": 150.0})  # e.g. 50 s at 1 thread + 50 s at 2
    assert (resumed.train_seconds, resumed.cpu_seconds) == (pytest.approx(110.0, abs=0.1), pytest.approx(170.0, abs=0.1))
    assert session(2, {"train_seconds": 100.0}).cpu_seconds is None           # an older state: unknown, not guessed
    assert session(None).cpu_seconds is None                                  # this session on an accelerator
    assert session(2, {"train_seconds": 100.0, "cpu_seconds": None}).cpu_seconds is None  # an earlier one was
    assert session(1, {"train_seconds": 0.0}).cpu_seconds == pytest.approx(10.0, abs=0.1)
    assert resumed.state(6)["cpu_seconds"] == pytest.approx(170.0, abs=0.1)


def test_chat_kind_names_what_the_recipe_generated():
    """The card's label follows the recipe's rows: a packed file without reading tasks does not claim them."""
    sys.path.insert(0, str(SCRIPT.parent))
    import train_drafter

    rows = {"reading: python-docs / greedy": 3, "self-instruct / greedy": 5, "self-instruct follow-up / greedy": 1}
    assert train_drafter.chat_kind({"rows": rows}) == "chat, self-distilled (reading tasks + self-instruct)"
    packed = {"rows": {"self-instruct / greedy": 970, "self-instruct / sampled t=0.7": 970}}
    assert train_drafter.chat_kind(packed) == "chat, self-distilled (self-instruct)"
    assert train_drafter.chat_kind(None) == "chat"
    answered = {"rows": {"prompts:chat_prompts_train_large.jsonl / greedy": 2000}}
    assert train_drafter.chat_kind(answered) == "chat, self-distilled (a prompts file)"
