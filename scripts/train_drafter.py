"""Train Medusa heads, an EAGLE drafter or an early-exit adapter for a frozen target (a straight ``Accelerator`` loop).

The target is frozen and moved to the device (never prepared); only the head trains. Data: any ``datasets`` source
(``--dataset`` repeatable: ``corpus:NAME``, local .txt/.jsonl, or a ``load_dataset`` name); rows with a prompt column
become chat conversations, answered by the target itself with ``--self_distill`` (batched, cached on disk).
Target features are computed online, or once up front with ``--cache_features`` (safetensors shards).

Run (one CPU process; on GPUs drop ``--cpu`` and set ``--num_processes``):

    accelerate launch --num_processes 1 --cpu scripts/train_drafter.py --head medusa --base_model bundled \
        --dataset corpus:python-docs --dataset scripts/train_configs/chat_prompts_train.jsonl --self_distill \
        --cache_features --max_steps 600 --output_dir runs/medusa

    python scripts/train_drafter.py --config scripts/train_configs/smollm2_eagle.yaml   # YAML, CLI overrides it
    python scripts/train_drafter.py --config ... --resume_from_checkpoint latest         # continue after a crash
    python scripts/train_drafter.py --config ... --resume_weights_from DIR   # continue in a new session (see below)
    python scripts/train_drafter.py --config ... --evaluate_only DIR         # held-out numbers of a saved head
    python scripts/train_drafter.py --config scripts/train_configs/smollm2_early_exit.yaml  # exit adapter, E = 8

``--head early_exit --exit_layer E`` trains an ``ExitAdapter`` on the target's layer-E states (``hidden_states[E]``)
against the target's greedy token at the same row; the held-out numbers come from ``evaluate_exit_adapter``.

Outputs in ``--output_dir``: ``config.json`` + ``model.safetensors`` (the head only), ``README.md`` (model card),
``training_summary.json``, ``train_log.jsonl``, ``checkpoints/step-N`` (``accelerator.save_state``, plus the head
alone in ``checkpoints/step-N/head``: ``save_pretrained`` in ``--save_dtype`` with ``trainer_state.json``).

Across sessions: the full state (optimizer included) is several times the head and stays under ``runs/``; a
checkpoint's ``head/`` folder is small enough to commit. ``--resume_weights_from`` that folder continues the run
from its weights, step (learning-rate schedule, data order) and run record; only AdamW's moments start again.
"""

from __future__ import annotations

import json
import math
import random
import shlex
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import yaml
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, GradientAccumulationPlugin, set_seed
from tqdm.auto import tqdm
from transformers import HfArgumentParser, get_cosine_schedule_with_warmup

from hf_kvspec.heads import data as data_lib
from hf_kvspec.heads.configuration import EagleConfig, MedusaConfig
from hf_kvspec.heads.distill import DistillSettings, self_distill
from hf_kvspec.heads.evaluation import evaluate_head
from hf_kvspec.heads.features import CachedFeatures, collate, extract_to_cache, target_features
from hf_kvspec.heads.modeling_eagle import EagleHead
from hf_kvspec.heads.modeling_medusa import MedusaHeads
from hf_kvspec.heads.objectives import TrainingObjective, TrainingVocabulary
from hf_kvspec.heads.pairing import base_model_fingerprint
from hf_kvspec.heads.trained_vocab import HeadVocabulary, init_draft_vocab, most_frequent_labels
from hf_kvspec.heads.warm_start import warm_start


@dataclass
class ModelArguments:
    head: str = field(metadata={"help": "medusa, eagle or early_exit", "choices": ["medusa", "eagle", "early_exit"]})
    base_model: str = field(default="bundled", metadata={"help": "bundled[:NAME], a local path or a Hub id"})
    base_model_hub_id: str | None = field(default=None, metadata={"help": "base_model in the card's metadata"})
    num_heads: int = field(default=4, metadata={"help": "Medusa heads (draft depth)"})
    num_layers: int = field(default=1, metadata={"help": "residual blocks per Medusa head"})
    exit_layer: int | None = field(default=None, metadata={"help": "early_exit: base layers that draft (E)"})
    adapter_intermediate_size: int | None = field(default=None, metadata={
        "help": "early_exit: adapter MLP width (default: the base model's intermediate_size)"})
    medusa_own_lm_head: bool = field(default=False, metadata={"help": "give each Medusa head its own [V, H] head"})
    feature_layers: list[int] = field(default_factory=lambda: [-1],
                                      metadata={"help": "EAGLE feature layers (several = EAGLE-3 fusion)"})
    architecture: str = field(default="eagle1", metadata={"help": "EAGLE layer: eagle1 or eagle3 (exportable to "
                                                                  "vLLM/SGLang)", "choices": ["eagle1", "eagle3"]})
    draft_vocab_size: int | None = field(default=None, metadata={
        "help": "EAGLE: train the head's own LM projection over the N most frequent target tokens (d2t/t2d saved)"})
    init_from: str | None = field(default=None, metadata={
        "help": "fine-tune: start from a trained head of the same kind (a saved head directory or bundled:KIND); "
                "with --draft_vocab_size a full-vocabulary source keeps its layers and the vocabulary is chosen "
                "from the data"})
    init_across_layouts: bool = field(default=False, metadata={
        "help": "--init_from an eagle1 head into an eagle3 one (or the reverse): copy only the layer after its "
                "attention (o_proj, post-attention norm, MLP, final norm); the rest starts fresh"})


@dataclass
class DataArguments:
    dataset: list[str] = field(default_factory=list, metadata={"help": "source spec, repeatable"})
    dataset_split: str = "train"
    text_column: str = "text"
    prompt_column: str = "prompt"
    response_column: str = "response"
    self_distill: bool = field(default=False, metadata={"help": "answer prompt rows with the target itself"})
    distill_max_new_tokens: int = 128
    distill_batch_size: int = 16
    max_length: int = 256
    max_train_tokens: int | None = field(default=None, metadata={"help": "token budget per text source"})
    data_seed: int = 0
    label_source: str = field(default="target", metadata={"choices": ["target", "data"]})
    cache_features: bool = field(default=False, metadata={"help": "pre-extract target features to shards"})
    feature_batch_size: int = 8
    data_cache_dir: str | None = field(default=None, metadata={"help": "default ~/.cache/hf_kvspec/drafter_data"})
    eval_prompts: str | None = field(default=None, metadata={"help": "held-out prompts (JSONL/text) for the card"})
    check_held_out: bool = field(default=False, metadata={
        "help": "refuse prompt rows that leak --eval_prompts (prompts, topics, templates); chat rows from "
                "make_distill_data.py are always checked"})
    prepare_data_only: bool = field(default=False, metadata={"help": "stop after self-distillation + features"})


@dataclass
class TrainArguments:
    output_dir: str = "runs/drafter"
    max_steps: int = 200
    per_device_batch_size: int = 8
    gradient_accumulation_steps: int = 1
    learning_rate: float = 1e-3
    weight_decay: float = 0.0
    warmup_steps: int = 20
    max_grad_norm: float = 1.0
    mixed_precision: str = field(default="no", metadata={"choices": ["no", "bf16", "fp16"]})
    seed: int = 0
    save_steps: int = 100
    resume_from_checkpoint: str | None = field(default=None, metadata={"help": "a checkpoint dir or 'latest'"})
    resume_weights_from: str | None = field(default=None, metadata={
        "help": "continue from a head directory holding trainer_state.json (a checkpoint's head/ folder, or one "
                "committed from it): its weights take the place of --init_from, its step sets the schedule position "
                "and the data order, its run record (commands, seconds) carries on; the optimizer restarts"})
    evaluate_only: str | None = field(default=None, metadata={
        "help": "measure the saved head in this directory on --eval_prompts, print the result as JSON, train nothing"})
    logging_steps: int = 10
    unroll_steps: int = field(default=1, metadata={"help": "EAGLE training-time-test steps"})
    feature_loss_weight: float = 1.0
    loss_decay: float = field(default=0.8, metadata={"help": "weight decay**k of head/step k"})
    loss_on: str = field(default="answers", metadata={
        "choices": ["answers", "all"], "help": "score only rows whose label is an answer token of a chat example "
                                               "(the bundled v1 heads and exit adapter were trained with 'all')"})
    train_vocab: str = field(default="labels", metadata={"choices": ["labels", "full"],
                                                         "help": "softmax over label tokens only (training only)"})
    train_vocab_size: int | None = field(default=None, metadata={"help": "keep the N most frequent label tokens"})
    num_threads: int | None = None
    save_dtype: str = field(default="float32", metadata={"choices": ["float32", "float16", "bfloat16"],
                                                         "help": "dtype of the saved head (held-out numbers are "
                                                                 "measured on the saved weights)"})
    push_to_hub: bool = False
    hub_model_id: str | None = None
    hub_private: bool = False
    max_train_seconds: float | None = field(default=None, metadata={
        "help": "wall-clock cap on the training loop (this process); when hit, training stops after the current "
                "step and the head is saved and evaluated as usual. The schedule still follows --max_steps."})


def parse_args(argv: list[str]) -> tuple[ModelArguments, DataArguments, TrainArguments]:
    """CLI parsed into the three dataclasses; ``--config FILE.yaml`` supplies defaults that the CLI overrides.
    Every argument that can be checked without loading the model is checked here (exit 2, message names the fix)."""
    parser = HfArgumentParser((ModelArguments, DataArguments, TrainArguments))
    if "--config" in argv:
        at = argv.index("--config")
        if at + 1 >= len(argv) or argv[at + 1].startswith("--"):
            parser.error("--config needs a YAML file, e.g. --config scripts/train_configs/smollm2_eagle.yaml")
        if not Path(argv[at + 1]).is_file():
            parser.error(f"--config {argv[at + 1]}: no such file")
        config = yaml.safe_load(Path(argv[at + 1]).read_text()) or {}
        if not isinstance(config, dict):
            parser.error(f"--config {argv[at + 1]}: the YAML must map flag names to values")
        argv = _yaml_to_argv(config) + argv[:at] + argv[at + 2:]
    m, d, t = parser.parse_args_into_dataclasses(args=argv)
    problems = argument_problems(m, d, t)
    if not problems:
        try:
            problems = base_model_problems(m)  # reads the base model's config only, no weights
        except (OSError, ValueError) as err:
            parser.error(f"--base_model {m.base_model}: cannot read its config ({err}); pass bundled[:NAME], a "
                         "local model directory or a Hub id")
    if problems:
        parser.error("\n  ".join(problems))
    return m, d, t


_AT_LEAST_ONE = {  # flag -> why it needs an int >= 1
    "num_heads": "Medusa draft depth", "num_layers": "residual blocks per Medusa head",
    "max_steps": "optimizer steps; 0 would save an untrained head", "per_device_batch_size": "examples per step",
    "gradient_accumulation_steps": "micro-batches per step", "save_steps": "steps between checkpoints",
    "logging_steps": "steps between log lines", "unroll_steps": "EAGLE training-time-test steps",
    "distill_max_new_tokens": "answer length", "distill_batch_size": "prompts per generate call",
    "feature_batch_size": "examples per feature forward",
}
_OPTIONAL_AT_LEAST_ONE = {  # flag -> meaning (None = not set)
    "draft_vocab_size": "target tokens the EAGLE head projects onto",
    "train_vocab_size": "label tokens the training softmax keeps",
    "exit_layer": "base layers that draft", "adapter_intermediate_size": "adapter MLP width",
    "max_train_tokens": "token budget per text source", "num_threads": "torch threads",
}


def argument_problems(m: ModelArguments, d: DataArguments, t: TrainArguments) -> list[str]:
    """Each argument that cannot work, with the fix; what needs the base model's config is ``base_model_problems``."""
    values = {**asdict(m), **asdict(d), **asdict(t)}
    problems = [f"--{k} {values[k]}: needs an int >= 1 ({why})" for k, why in _AT_LEAST_ONE.items()
                if values[k] < 1]
    problems += [f"--{k} {values[k]}: needs an int >= 1 ({why}), or leave it unset" for k, why in
                 _OPTIONAL_AT_LEAST_ONE.items() if values[k] is not None and values[k] < 1]
    if d.max_length < 2:
        problems.append(f"--max_length {d.max_length}: needs >= 2 tokens (a position and the label after it)")
    for flag, value in (("max_grad_norm", t.max_grad_norm), ("loss_decay", t.loss_decay)):
        if not math.isfinite(value) or value <= 0:
            problems.append(f"--{flag} {value}: needs a number > 0")
    for flag, value in (("learning_rate", t.learning_rate), ("weight_decay", t.weight_decay),  # lr 0: a dry run
                        ("warmup_steps", t.warmup_steps), ("feature_loss_weight", t.feature_loss_weight)):
        if not math.isfinite(value) or value < 0:
            problems.append(f"--{flag} {value}: needs a number >= 0")
    if t.max_train_seconds is not None and not t.max_train_seconds >= 0:  # 0: stop after the first step
        problems.append(f"--max_train_seconds {t.max_train_seconds}: needs a number of seconds >= 0, or leave it "
                        "unset")
    if t.resume_from_checkpoint and t.resume_weights_from:
        problems.append("--resume_from_checkpoint and --resume_weights_from: pass one (the full state of a run under "
                        "runs/, or a head folder with its trainer_state.json)")
    if t.resume_weights_from and not (Path(t.resume_weights_from) / "trainer_state.json").is_file():
        problems.append(f"--resume_weights_from {t.resume_weights_from}: no trainer_state.json there; pass a "
                        "checkpoint's head/ folder (checkpoints/step-N/head) or a folder committed from one")
    if t.evaluate_only and not d.eval_prompts:
        problems.append(f"--evaluate_only {t.evaluate_only}: name the held-out prompts with --eval_prompts")
    if m.head == "early_exit" and m.exit_layer is None:
        problems.append("--head early_exit needs --exit_layer E (the number of base layers that draft)")
    if not d.dataset:
        problems.append("--dataset: name at least one source (a text/JSONL file, a corpus or a Hub dataset)")
    return problems


def base_model_problems(m: ModelArguments) -> list[str]:
    """Layer indices and vocabulary sizes checked against the base model's config (no weights are loaded)."""
    config = load_base_config(m.base_model).get_text_config()
    depth, vocab = config.num_hidden_layers, config.vocab_size
    problems = []
    if m.head == "early_exit" and not 1 <= m.exit_layer < depth:
        problems.append(f"--exit_layer {m.exit_layer}: the base model has {depth} layers; use 1..{depth - 1}")
    if m.head == "eagle":
        bad = [i for i in m.feature_layers if not -(depth + 1) <= i <= depth]
        if bad:
            problems.append(f"--feature_layers {bad}: index the base model's hidden states, {-(depth + 1)}..{depth} "
                            f"({depth} layers; 0 = embeddings, -1 = final)")
    if m.draft_vocab_size is not None and m.draft_vocab_size > vocab:
        problems.append(f"--draft_vocab_size {m.draft_vocab_size}: the base vocabulary has {vocab} tokens; use "
                        f"1..{vocab} (or leave it unset for the full vocabulary)")
    return problems


def load_base_config(spec: str):
    """The base model's config for ``bundled[:NAME]`` or a path/Hub id, without its weights."""
    from transformers import AutoConfig

    if spec == "bundled" or spec.startswith("bundled:"):
        from hf_kvspec.models import DEFAULT_MODEL, bundled_model_path

        return AutoConfig.from_pretrained(bundled_model_path(spec.partition(":")[2] or DEFAULT_MODEL))
    return AutoConfig.from_pretrained(spec)


def _yaml_to_argv(config: dict) -> list[str]:
    argv = []
    for key, value in config.items():
        values = value if isinstance(value, list) else [value]  # list fields take several values after one flag
        argv += [f"--{key}", *map(str, values)]
    return argv


def load_target(spec: str):
    """(model, tokenizer, recorded name, hub id) for ``bundled[:NAME]`` or a path/Hub id. Frozen, eval mode."""
    if spec == "bundled" or spec.startswith("bundled:"):
        from hf_kvspec.models import DEFAULT_MODEL, load_bundled_model

        name = spec.partition(":")[2] or DEFAULT_MODEL
        model, tokenizer = load_bundled_model(name)
        hub_id = "HuggingFaceTB/SmolLM2-135M-Instruct" if name == "smollm2-135m-instruct" else None
        recorded = f"bundled:{name}"
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model, tokenizer = AutoModelForCausalLM.from_pretrained(spec), AutoTokenizer.from_pretrained(spec)
        recorded = hub_id = spec
    return model.eval().requires_grad_(False), tokenizer, recorded, hub_id


def build_sources(d: DataArguments, target, tokenizer, cache_root: Path) -> list[tuple[dict, list[dict]]]:
    """[(recipe row, examples)] per ``--dataset`` source; the recipe row says what went in, for the card."""
    columns = data_lib.Columns(d.text_column, d.prompt_column, d.response_column)
    held_out = data_lib.HeldOut.from_file(d.eval_prompts, d.prompt_column) if d.eval_prompts else None
    sources = []
    for spec in d.dataset:
        dataset = data_lib.load_source(spec, d.dataset_split)
        if data_lib.MESSAGES in dataset.column_names:  # whole chats (make_distill_data.py), answers included
            sources.append(chat_source(d, spec, dataset, tokenizer, held_out))
            continue
        if held_out is not None and d.check_held_out:
            held_out.check(data_lib.user_turns(dataset, d.prompt_column), f"prompts of --dataset {spec}")
        texts, pairs = data_lib.split_rows(dataset, columns)
        windows = data_lib.text_windows(tokenizer, texts, d.max_length)
        random.Random(d.data_seed).shuffle(windows)  # a token budget then samples the whole source, not its head
        found = data_lib.cap_tokens(windows, d.max_train_tokens)
        found += conversations(d, target, tokenizer, pairs, cache_root)
        kind = "chat, self-distilled" if pairs and d.self_distill else ("chat" if pairs else "text")
        sources.append(({"source": spec, "kind": kind, "sequences": len(found),
                         "tokens": sum(len(e["input_ids"]) for e in found)}, found))
    if not any(examples for _, examples in sources):
        raise ValueError("No training examples: pass --dataset (e.g. corpus:python-docs or a .jsonl file).")
    return sources


def chat_source(d: DataArguments, spec: str, dataset, tokenizer, held_out) -> tuple[dict, list[dict]]:
    """A ``messages`` source: held-out check on every user turn, loss on each chat's last answer, and the recipe
    written beside the file (``<file>.recipe.json``) carried into the summary for the model card."""
    from hf_kvspec.heads.self_instruct import recipe_path

    if held_out is not None:
        held_out.check(data_lib.user_turns(dataset), f"user turns of --dataset {spec}")
    found = [data_lib.message_example(tokenizer, chat, d.max_length) for chat in dataset[data_lib.MESSAGES]]
    recipe = json.loads(recipe_path(spec).read_text()) if recipe_path(spec).is_file() else None
    row = {"source": spec, "kind": chat_kind(recipe), "sequences": len(found),
           "tokens": sum(len(e["input_ids"]) for e in found)}
    if recipe is not None:
        row["recipe"] = recipe
    return row, found


def chat_kind(recipe: dict | None) -> str:
    """The card's label of a chats file, from the row names of its recipe (``make_distill_data.py``, packed or not):
    ``"chat, self-distilled (self-instruct + reading tasks)"``, ``"... (a prompts file)"``; ``"chat"`` without one."""
    if recipe is None:
        return "chat"
    parts = dict.fromkeys("reading tasks" if name.startswith("reading") else
                          "a prompts file" if name.startswith("prompts:") else "self-instruct"
                          for name in recipe.get("rows", {}))
    return f"chat, self-distilled ({' + '.join(parts)})" if parts else "chat, self-distilled"


def conversations(d: DataArguments, target, tokenizer, pairs, cache_root: Path) -> list[dict]:
    """Prompt rows as chat examples: the dataset's responses, or the target's own with ``--self_distill``."""
    if not pairs:
        return []
    from hf_kvspec.heads.distill import Conversation, chat_prompt_ids

    if d.self_distill:
        convs = self_distill(target, tokenizer, [p for p, _ in pairs], cache_root / "self_distill.jsonl",
                             base_model_fingerprint(target), distill_settings(d))
    elif any(r is None for _, r in pairs):
        raise ValueError(f"Rows with a {d.prompt_column!r} column need a {d.response_column!r} column, or pass "
                         "--self_distill to let the target answer them.")
    else:
        convs = [Conversation(chat_prompt_ids(tokenizer, p), tokenizer(r, add_special_tokens=False)["input_ids"])
                 for p, r in pairs]
    return [data_lib.conversation_example(c, d.max_length) for c in convs]


def distill_settings(d: DataArguments) -> DistillSettings:
    return DistillSettings(max_new_tokens=d.distill_max_new_tokens, batch_size=d.distill_batch_size)


def build_head(m: ModelArguments, target, recorded_name: str):
    if m.head == "early_exit":
        return build_exit_adapter(m, target, recorded_name)
    if m.head == "medusa":
        config = MedusaConfig.for_base_model(target, recorded_name, num_heads=m.num_heads, num_layers=m.num_layers,
                                             share_lm_head=not m.medusa_own_lm_head)
        return MedusaHeads(config).attach(target)
    return EagleHead(EagleConfig.for_base_model(target, recorded_name, feature_layers=m.feature_layers,
                                                   architecture=m.architecture,
                                                   draft_vocab_size=m.draft_vocab_size)).attach(target)


def build_exit_adapter(m: ModelArguments, target, recorded_name: str):
    from hf_kvspec.heads.configuration_exit import ExitAdapterConfig
    from hf_kvspec.heads.modeling_exit import ExitAdapter

    if m.exit_layer is None:
        raise ValueError("--head early_exit needs --exit_layer E (the number of base layers that draft).")
    width = {} if m.adapter_intermediate_size is None else {"intermediate_size": m.adapter_intermediate_size}
    config = ExitAdapterConfig.for_base_model(target, recorded_name, exit_layer=m.exit_layer, **width)
    return ExitAdapter(config).attach(target)


def make_objective(m, d, t, head, vocab):
    """The head's loss module: ``ExitObjective`` (CE on the target's greedy tokens) or ``TrainingObjective``."""
    if m.head == "early_exit":
        from hf_kvspec.heads.modeling_exit import ExitObjective

        return ExitObjective(head, vocab, answers_only=t.loss_on == "answers")
    return TrainingObjective(head, vocab, d.label_source, t.unroll_steps, t.feature_loss_weight, t.loss_decay,
                             answers_only=t.loss_on == "answers")


def feature_layers(m: ModelArguments) -> list[int]:
    if m.head == "early_exit":
        return [m.exit_layer]  # hidden_states[E]: the output of layers 0..E-1
    return [-1] if m.head == "medusa" else list(m.feature_layers)


def training_set(m, d, target, sources, cache_root: Path, accelerator):
    """Cached feature shards per source (``--cache_features``; adding a source reuses the others' caches), or the
    raw examples (features computed in the loop)."""
    if not d.cache_features:
        return [example for _, examples in sources for example in examples]
    parts, layers = [], feature_layers(m)
    for _, examples in sources:
        if not examples:
            continue
        meta = {"fingerprint": base_model_fingerprint(target), "examples_hash": _examples_hash(examples)}
        directory = cache_root / "features" / f"{meta['examples_hash'][:16]}-{'_'.join(map(str, layers))}"
        with accelerator.main_process_first():
            if accelerator.is_main_process:
                extract_to_cache(target, examples, directory, layers, meta, d.feature_batch_size)
        parts.append(CachedFeatures(directory, expected_meta=meta))
    return torch.utils.data.ConcatDataset(parts)


def _examples_hash(examples: list[dict]) -> str:
    import hashlib

    digest = hashlib.sha256()
    for example in examples:
        digest.update(json.dumps([example["input_ids"], example["prompt_length"]]).encode())
    return digest.hexdigest()


def with_features(batch: dict, target, layers: list[int], device) -> dict:
    """Move a batch to the device, computing target features online when they were not pre-extracted."""
    batch = {k: v.to(device) for k, v in batch.items()}
    if "features" not in batch:
        batch["features"], batch["target_tokens"] = target_features(target, batch["input_ids"], batch["valid"],
                                                                    layers)
    return batch


def find_checkpoint(output_dir: Path, spec: str) -> Path | None:
    if spec != "latest":
        return Path(spec)
    found = sorted((output_dir / "checkpoints").glob("step-*"), key=lambda p: int(p.name.split("-")[1]))
    return found[-1] if found else None


@dataclass
class RunRecord:
    """What a run carries across resumes: the commands that produced it, wall time, last logged metrics."""

    commands: list[str]
    seconds_before: float = 0.0
    started: float = field(default_factory=time.time)
    last_metrics: dict = field(default_factory=dict)
    stopped_at_step: int | None = None  # set when --max_train_seconds cut the run short
    initialised_from: dict | None = None  # the run's first --init_from (kept when a later session continues it)
    cpu_threads: int | None = None  # torch threads of this process when it trains on the CPU; None on an accelerator
    cpu_seconds_before: float | None = 0.0  # CPU-thread seconds of earlier sessions (None: one was not on a CPU)

    @property
    def train_seconds(self) -> float:
        return round(self.seconds_before + time.time() - self.started, 3)  # ms: a tiny run still counts

    @property
    def cpu_seconds(self) -> float | None:
        """Wall seconds x torch threads, summed over the sessions of the run: the card's CPU-hours. None once any
        session trained on an accelerator or did not record it."""
        if self.cpu_threads is None or self.cpu_seconds_before is None:
            return None
        return round(self.cpu_seconds_before + (time.time() - self.started) * self.cpu_threads, 3)

    def state(self, step: int) -> dict:
        return {"completed_steps": step, "commands": self.commands, "train_seconds": self.train_seconds,
                "cpu_seconds": self.cpu_seconds, "last_metrics": self.last_metrics,
                "initialised_from": self.initialised_from}

    def resume(self, state: dict) -> int:
        self.commands = state.get("commands", []) + self.commands
        self.seconds_before = state.get("train_seconds", 0.0)
        self.cpu_seconds_before = state.get("cpu_seconds", 0.0 if not state.get("train_seconds") else None)
        self.last_metrics = state.get("last_metrics", {})
        self.initialised_from = state.get("initialised_from", self.initialised_from)
        return state["completed_steps"]


def save_checkpoint(accelerator, output_dir: Path, step: int, record: RunRecord, objective, dtype: str) -> None:
    """The full state (``save_state``) and, in ``head/``, the head alone in ``dtype`` (what a session commits)."""
    directory = output_dir / "checkpoints" / f"step-{step}"
    accelerator.save_state(str(directory))
    if accelerator.is_main_process:
        state = json.dumps(record.state(step), indent=2)
        (directory / "trainer_state.json").write_text(state)
        head = accelerator.unwrap_model(objective).head
        weights = {k: v.to(getattr(torch, dtype)) if v.is_floating_point() else v
                   for k, v in head.state_dict().items()}  # a cast copy: the training head stays fp32
        head.save_pretrained(directory / "head", state_dict=weights)
        (directory / "head" / "trainer_state.json").write_text(state)


def train(m, d, t, accelerator, objective, dataset, target, record: RunRecord, start_step: int = 0) -> None:
    """The loop: accumulate, clip, step, schedule, log, checkpoint (``record`` keeps the last logged metrics).
    ``start_step``: steps a ``--resume_weights_from`` head already took (schedule and data order continue there)."""
    loader = torch.utils.data.DataLoader(dataset, batch_size=t.per_device_batch_size, shuffle=True,
                                         collate_fn=collate)
    optimizer = torch.optim.AdamW([p for p in objective.parameters() if p.requires_grad], lr=t.learning_rate,
                                  weight_decay=t.weight_decay)
    scheduler = get_cosine_schedule_with_warmup(optimizer, t.warmup_steps, t.max_steps * accelerator.num_processes)
    objective, optimizer, loader, scheduler = accelerator.prepare(objective, optimizer, loader, scheduler)
    target.to(accelerator.device)  # frozen: moved, not prepared (DDP refuses modules without trainable parameters)
    output_dir, completed = Path(t.output_dir), start_step
    _advance(scheduler, start_step * accelerator.num_processes)
    checkpoint = find_checkpoint(output_dir, t.resume_from_checkpoint) if t.resume_from_checkpoint else None
    if checkpoint is not None:
        accelerator.load_state(str(checkpoint))
        completed = record.resume(json.loads((checkpoint / "trainer_state.json").read_text()))
        accelerator.print(f"resumed from {checkpoint} at step {completed}")
    micro = completed * t.gradient_accumulation_steps
    epoch, skip = divmod(micro, len(loader))
    bar = tqdm(total=t.max_steps, initial=completed, desc=f"train {m.head}", disable=not accelerator.is_main_process)
    window = _Window(record)
    while completed < t.max_steps:
        loader.set_epoch(epoch)
        batches = accelerator.skip_first_batches(loader, skip) if skip else loader
        for batch in batches:
            batch = with_features(batch, target, feature_layers(m), accelerator.device)
            with accelerator.accumulate(objective), accelerator.autocast():
                out = objective(batch)
                accelerator.backward(out.loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(objective.parameters(), t.max_grad_norm)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            window.add(out)
            if not accelerator.sync_gradients:
                continue
            completed += 1
            bar.update(1)
            bar.set_postfix(window.postfix())
            if completed % t.logging_steps == 0 or completed == t.max_steps:
                _log(accelerator, output_dir, completed, window, scheduler)
            if completed % t.save_steps == 0 or completed == t.max_steps:
                save_checkpoint(accelerator, output_dir, completed, record, objective, t.save_dtype)
            if completed >= t.max_steps or _out_of_time(t, record):
                break
        if completed < t.max_steps and _out_of_time(t, record):
            accelerator.print(f"--max_train_seconds {t.max_train_seconds} reached: stopping at step {completed} of "
                              f"{t.max_steps}")
            record.stopped_at_step = completed
            if completed % t.save_steps:
                save_checkpoint(accelerator, output_dir, completed, record, objective, t.save_dtype)
            break
        epoch, skip = epoch + 1, 0
    bar.close()


def _advance(scheduler, steps: int) -> None:
    """Move the schedule to ``steps`` (a weights-only resume: no optimizer step has run in this process)."""
    import warnings

    with warnings.catch_warnings():  # "lr_scheduler.step() before optimizer.step()": intended here
        warnings.simplefilter("ignore", UserWarning)
        for _ in range(steps):
            scheduler.scheduler.step()  # the wrapped LambdaLR: accelerate's wrapper steps only after an optimizer step


def _out_of_time(t: TrainArguments, record: RunRecord) -> bool:
    return t.max_train_seconds is not None and time.time() - record.started >= t.max_train_seconds


class _Window:
    """Running loss / per-head top-1 since the last log line."""

    def __init__(self, record: RunRecord):
        self.reset()
        self.record = record

    def reset(self):
        self.loss, self.batches, self.correct, self.counts = 0.0, 0, None, None

    def add(self, out):
        self.loss += out.loss.item()
        self.batches += 1
        self.correct = out.correct.float() if self.correct is None else self.correct + out.correct.float()
        self.counts = out.counts.float() if self.counts is None else self.counts + out.counts.float()

    def metrics(self) -> dict:
        top1 = (self.correct / self.counts.clamp(min=1)).tolist() if self.counts is not None else []
        return {"loss": self.loss / max(self.batches, 1), "top1": [round(x, 4) for x in top1]}

    def postfix(self) -> dict:
        metrics = self.metrics()
        return {"loss": f"{metrics['loss']:.3f}", "top1": "/".join(f"{x:.2f}" for x in metrics["top1"])}


def _log(accelerator, output_dir: Path, step: int, window: _Window, scheduler) -> None:
    window.record.last_metrics = {"step": step, **window.metrics(), "lr": scheduler.get_last_lr()[0]}
    window.reset()
    if accelerator.is_main_process:
        output_dir.mkdir(parents=True, exist_ok=True)
        with (output_dir / "train_log.jsonl").open("a") as sink:
            sink.write(json.dumps(window.record.last_metrics) + "\n")


def held_out(d: DataArguments, head, target, tokenizer, cache_root: Path) -> dict | None:
    """Per-head top-1 and chain tau on the target's greedy answers to ``--eval_prompts``, through the
    ``draft_acceptance`` metric (``hf_kvspec.load_metric``; ``evaluate_head`` feeds it)."""
    if not d.eval_prompts:
        return None
    convs = held_out_conversations(d, target, tokenizer, cache_root)
    if getattr(head.config, "exit_layer", None) is not None:  # ExitAdapter: chain of 4 drafts per round
        from hf_kvspec.heads.evaluation_exit import evaluate_exit_adapter

        result = evaluate_exit_adapter(head, target, convs)
    else:
        result = evaluate_head(head, target, convs)
    return {**result, "prompts": len(convs), "source": d.eval_prompts}


def held_out_conversations(d: DataArguments, target, tokenizer, cache_root: Path):
    """The target's greedy answers to ``--eval_prompts`` (generated once, then read from the distillation cache)."""
    prompts = data_lib.read_prompts(d.eval_prompts, d.prompt_column)
    return self_distill(target, tokenizer, prompts, cache_root / "self_distill.jsonl", base_model_fingerprint(target),
                        distill_settings(d))


def evaluate_saved(d: DataArguments, directory: str, target, tokenizer, cache_root: Path) -> dict:
    """``held_out`` of the head saved in ``directory`` (fp32 compute), with the step its trainer_state.json names."""
    from hf_kvspec.heads.registration import HEAD_CLASSES

    model_type = json.loads((Path(directory) / "config.json").read_text())["model_type"]
    head_class = {config.model_type: model for config, model in HEAD_CLASSES}[model_type]
    head = head_class.from_pretrained(directory, dtype=torch.float32).attach(target).eval()
    state_file = Path(directory) / "trainer_state.json"
    step = json.loads(state_file.read_text())["completed_steps"] if state_file.is_file() else None
    return {"head": directory, "step": step, **held_out(d, head, target, tokenizer, cache_root)}


def finish(m, d, t, accelerator, objective, target, tokenizer, summary: dict, cache_root: Path) -> None:
    """Save the head, evaluate it on held-out prompts, write the card and summary, push if asked."""
    from hf_kvspec import hub

    head = accelerator.unwrap_model(objective).head
    output_dir = Path(t.output_dir)
    head.to(getattr(torch, t.save_dtype)).save_pretrained(output_dir)
    # measure what was stored: reload the saved weights (fp32 compute) and evaluate those
    device = next(target.parameters()).device
    stored = type(head).from_pretrained(output_dir, dtype=torch.float32).attach(target).to(device).eval()
    summary["held_out"] = held_out(d, stored, target, tokenizer, cache_root)
    (output_dir / "training_summary.json").write_text(json.dumps(summary, indent=2))
    card = hub.render_model_card(head.config, hub.CardFields.from_summary(summary))
    (output_dir / "README.md").write_text(card)
    if t.push_to_hub:
        head.push_to_hub(t.hub_model_id or output_dir.name, card=card, private=t.hub_private)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    m, d, t = parse_args(argv)
    if t.num_threads:
        torch.set_num_threads(t.num_threads)
    accelerator = Accelerator(
        mixed_precision=t.mixed_precision,
        gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=t.gradient_accumulation_steps,
                                                                sync_with_dataloader=False),
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
    )
    set_seed(t.seed)
    target, tokenizer, recorded_name, hub_id = load_target(m.base_model)
    target.to(accelerator.device)  # self-distillation and feature extraction run where training runs
    cache_root = Path(d.data_cache_dir) if d.data_cache_dir else _default_cache()
    if t.evaluate_only:  # no training data needed: the held-out answers come from the distillation cache
        print(json.dumps(evaluate_saved(d, t.evaluate_only, target, tokenizer, cache_root)))
        return
    with accelerator.main_process_first():
        sources = build_sources(d, target, tokenizer, cache_root)
    recipe = [row for row, _ in sources]
    dataset = training_set(m, d, target, sources, cache_root, accelerator)
    if d.prepare_data_only:
        if d.eval_prompts and d.self_distill and accelerator.is_main_process:  # held-out answers cached too
            held_out_conversations(d, target, tokenizer, cache_root)
        accelerator.print(f"data ready: {json.dumps(recipe)}")
        return
    head = build_head(m, target, recorded_name)
    record = RunRecord(commands=["accelerate launch scripts/train_drafter.py " + shlex.join(argv)],
                       cpu_threads=torch.get_num_threads() if accelerator.device.type == "cpu" else None)
    start_step, source = 0, t.resume_weights_from or m.init_from
    if t.resume_weights_from:  # the committed head's step and run record; its weights are the warm start below
        start_step = record.resume(json.loads((Path(source) / "trainer_state.json").read_text()))
    warm = warm_start(head, source, target, m.init_across_layouts) if source else None
    if warm is not None:
        fresh = f"; layout {warm.layout_change}, fresh: {', '.join(warm.left_fresh)}" if warm.layout_change else ""
        accelerator.print(f"--init_from {warm.source}: {warm.tensors_copied} tensors ({warm.parameters_copied:,} "
                          f"parameters) copied; draft vocabulary: {warm.draft_vocab or 'none'}{fresh}")
    vocab = (TrainingVocabulary(target.config.vocab_size) if t.train_vocab == "full" else
             TrainingVocabulary.from_label_counts(dataset, target.config.vocab_size, t.train_vocab_size))
    if getattr(head, "has_draft_vocab", False):  # EAGLE-3 draft vocabulary: train the head's own [N, H] projection
        if warm is None or not warm.draft_vocab_from_source:
            init_draft_vocab(head, most_frequent_labels(dataset, target.config.vocab_size, m.draft_vocab_size))
        vocab = HeadVocabulary(head)
    objective = make_objective(m, d, t, head, vocab)
    if warm is not None and not t.resume_weights_from:  # a resumed run keeps its first run's warm start
        record.initialised_from = asdict(warm)
    train(m, d, t, accelerator, objective, dataset, target, record, start_step)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        summary = {"command": "\n".join(record.commands),
                   "args": {**asdict(m), **asdict(d), **asdict(t)}, "base_model_hub_id": m.base_model_hub_id or hub_id,
                   "data": recipe, "initialised_from": record.initialised_from,
                   "training_vocab_size": len(vocab.vocab_ids) if vocab.vocab_ids is not None else
                   target.config.vocab_size, "final_train_metrics": record.last_metrics,
                   "train_seconds": record.train_seconds, "cpu_seconds": record.cpu_seconds,
                   "stopped_at_step": record.stopped_at_step,
                   "trainable_parameters":
                   sum(p.numel() for p in head.parameters())}
        finish(m, d, t, accelerator, objective, target, tokenizer, summary, cache_root)
    accelerator.end_training()


def _default_cache() -> Path:
    from hf_kvspec.models import cache_dir

    return cache_dir() / "drafter_data"


if __name__ == "__main__":
    main()
