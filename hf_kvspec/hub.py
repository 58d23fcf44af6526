"""Model cards and Hub uploads for draft heads.

Boundary: renders ``model_cards/draft_head.md`` (Jinja2, YAML metadata block) from a head's config and the measured
numbers it is given, and uploads a head folder through ``huggingface_hub.HfApi`` (create_repo + one create_commit).
Knows nothing about how the numbers were measured.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import yaml

TEMPLATE_DIR = Path(__file__).parent / "model_cards"  # links to the top-level model_cards/; copied into wheels
DEFAULT_TEMPLATE = "draft_head.md"
_KIND = {"hf_kvspec_medusa": ("Medusa heads", "medusa", "arxiv:2401.10774"),
         "hf_kvspec_eagle": ("EAGLE drafter", "eagle", "arxiv:2401.15077"),
         "hf_kvspec_exit_adapter": ("Early-exit adapter", "early-exit", "arxiv:2404.18911")}
_TEMPLATES = {"hf_kvspec_exit_adapter": "exit_adapter.md"}  # other heads: DEFAULT_TEMPLATE
#: what a card reads from ``CardFields.held_out``: the draft_acceptance result plus the prompt count and source
HELD_OUT_KEYS = ("tau", "per_head_top1", "emitted_tokens", "target_forwards", "prompts", "source")
_METADATA_ORDER = ["library_name", "license", "base_model", "tags", "datasets", "hf_kvspec_acceptance", "model-index"]


def _warm_start_sentence(warm: dict | None) -> str:
    """The card's note on ``--init_from`` (``training_summary.json``'s ``initialised_from``), or nothing."""
    if not warm:
        return ""
    vocab = "; draft vocabulary chosen from this data" if warm.get("draft_vocab") == "from data" else ""
    before = warm.get("source_training") or {}
    lineage = (f", itself trained for {before['steps']} steps on {before['tokens']:,} tokens"
               if before.get("steps") and before.get("tokens") else "")
    if before.get("held_out_tau") is not None:
        lineage += f" (held-out chain tau {before['held_out_tau']:.3f} before this fine-tuning)"
    if warm.get("layout_change"):
        fresh = ", ".join(f"`{name}`" for name in warm.get("left_fresh") or [])
        return (f" Partly warm-started across layouts ({warm['layout_change']}): the layer after its attention came "
                f"from `{warm['source']}` ({warm['parameters_copied']:,} parameters{vocab}){lineage}; {fresh} "
                "started fresh.")
    return (f" Fine-tuned: the weights started from `{warm['source']}` ({warm['parameters_copied']:,} parameters "
            f"copied{vocab}){lineage}, not from a random initialisation.")


@dataclass
class CardFields:
    """What a card says beyond the config. Numbers are printed as given; nothing is invented when absent."""

    repo_id: str | None = None
    base_model_hub_id: str | None = None
    datasets: list[str] = field(default_factory=list)
    license: str = "apache-2.0"
    command: str | None = None
    data: list[dict] = field(default_factory=list)              # [{"source", "kind", "sequences", "tokens"}]
    data_recipe: list[dict] = field(default_factory=list)       # make_distill_data.py recipes of the chat sources
    held_out: dict | None = None       # the draft_acceptance metric's result + prompts/source (evaluate_head)
    final_train_metrics: dict | None = None
    training_paragraph: str = ""
    speedup: str | None = None
    limitations: str = ""
    parameters: int | None = None

    def __post_init__(self):
        missing = [key for key in HELD_OUT_KEYS if key not in self.held_out] if self.held_out is not None else []
        if missing:
            raise ValueError(f"CardFields.held_out lacks {missing}: pass the draft_acceptance result of evaluate_head "
                             "plus 'prompts' (how many) and 'source' (where they came from), or leave it None.")

    @classmethod
    def from_summary(cls, summary: dict, **overrides) -> CardFields:
        """From ``training_summary.json`` written by ``scripts/train_drafter.py``."""
        args = summary.get("args", {})
        stopped = summary.get("stopped_at_step")
        steps = f"{stopped} of {args.get('max_steps')} planned" if stopped is not None else str(args.get('max_steps'))
        seconds = summary.get("train_seconds")
        wall = f"{seconds:.1f}" if isinstance(seconds, (int, float)) else seconds
        inference_vocab = ("the head drafts over the same vocabulary" if args.get("draft_vocab_size") else
                           "inference uses the full vocabulary")
        paragraph = (f"{steps} optimizer steps, batch {args.get('per_device_batch_size')} x "
                     f"{args.get('gradient_accumulation_steps')} accumulation, AdamW lr {args.get('learning_rate')} "
                     f"with {args.get('warmup_steps')} warm-up steps and cosine decay, labels from "
                     f"`{args.get('label_source')}`, training softmax over {summary.get('training_vocab_size')} "
                     f"tokens ({inference_vocab}), {wall} s wall clock.")
        if stopped is not None:
            paragraph += (f" The run was stopped by its `--max_train_seconds {args.get('max_train_seconds')}` cap "
                          f"after {stopped} of the {args.get('max_steps')} steps (the learning rate had not finished "
                          f"its decay).")
        if summary.get("cpu_seconds"):
            paragraph += (f" Training cost: {summary['cpu_seconds'] / 3600:.1f} CPU-hours (wall seconds x torch "
                          f"threads, summed over the run's sessions).")
        if args.get("mixed_precision") not in (None, "no"):
            paragraph += f" Mixed precision: {args['mixed_precision']}."
        if args.get("loss_on"):
            paragraph += (" Loss on answer tokens only." if args["loss_on"] == "answers" else
                          " Loss on every row, prompt tokens included.")
        paragraph += _warm_start_sentence(summary.get("initialised_from"))
        fields = dict(base_model_hub_id=summary.get("base_model_hub_id"), command=summary.get("command"),
                      data=summary.get("data", []), held_out=summary.get("held_out"),
                      data_recipe=[row["recipe"] for row in summary.get("data", []) if "recipe" in row],
                      final_train_metrics=summary.get("final_train_metrics"), training_paragraph=paragraph,
                      datasets=[row["source"] for row in summary.get("data", [])],
                      parameters=summary.get("trainable_parameters"))
        return cls(**{**fields, **overrides})


def card_metadata(config, fields: CardFields) -> dict:
    """The YAML block, built with ``huggingface_hub.ModelCardData``: library, base_model, tags, datasets, license, and
    when measured the held-out results twice: ``model-index`` (``EvalResult`` rows, what the Hub shows as evaluation
    results) and the compact ``hf_kvspec_acceptance`` summary."""
    from huggingface_hub import ModelCardData

    title, tag, paper = _KIND.get(config.model_type, (config.model_type, config.model_type, None))
    base_model = fields.base_model_hub_id or config.base_model_name_or_path
    measured = {}
    if fields.held_out:
        measured = {"model_name": fields.repo_id or f"{title} for {base_model}",
                    "eval_results": eval_results(fields.held_out),
                    "hf_kvspec_acceptance": {"tau": round(fields.held_out["tau"], 4),
                                             "per_head_top1": [round(x, 4) for x in fields.held_out["per_head_top1"]]}}
    metadata = ModelCardData(library_name="hf_kvspec", license=fields.license, base_model=base_model,
                         tags=["speculative-decoding", "draft-model", tag, "hf_kvspec"] + ([paper] if paper else []),
                         datasets=fields.datasets, **measured).to_dict()
    return {key: metadata[key] for key in sorted(metadata, key=_METADATA_ORDER.index)}


def eval_results(held_out: dict) -> list:
    """``draft_acceptance`` results (``hf_kvspec.load_metric``, configuration "chain") as ``EvalResult`` rows: chain
    tau, then top-1 agreement per draft position. Values rounded to 4 places, as in ``hf_kvspec_acceptance``."""
    from huggingface_hub import EvalResult

    common = dict(task_type="text-generation", task_name="Speculative decoding: draft acceptance",
                  dataset_type=held_out["source"], metric_type="draft_acceptance", metric_config="chain",
                  dataset_name=f"{held_out['prompts']} held-out chat prompts, answered greedily by the base model")
    rows = [EvalResult(metric_name="Chain τ (tokens per target forward)", metric_value=round(held_out["tau"], 4),
                       **common)]
    rows += [EvalResult(metric_name=f"Top-1 agreement, draft position {k + 1}", metric_value=round(top1, 4), **common)
             for k, top1 in enumerate(held_out["per_head_top1"])]
    return rows


def render_model_card(config, fields: CardFields | None = None, template: str | Path | None = None) -> str:
    """Render the card for a head config; ``template`` defaults to ``model_cards/draft_head.md`` (exit adapters:
    ``model_cards/exit_adapter.md``)."""
    import jinja2

    if getattr(config, "model_type", None) not in _KIND:
        raise TypeError(f"render_model_card takes a draft head's config (MedusaConfig or EagleConfig, or an "
                        f"ExitAdapterConfig; e.g. "
                        f"head.config), got {type(config).__name__}.")
    fields = fields or CardFields()
    path = Path(template) if template else TEMPLATE_DIR / _TEMPLATES.get(config.model_type, DEFAULT_TEMPLATE)
    if not path.is_file():
        raise FileNotFoundError(f"Model-card template {path} not found; pass template=<path to a .md template>.")
    title, _, _ = _KIND.get(config.model_type, (config.model_type, None, None))
    base_name = fields.base_model_hub_id or config.base_model_name_or_path
    env = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    return env.from_string(path.read_text()).render(
        metadata_yaml=yaml.safe_dump(card_metadata(config, fields), sort_keys=False, allow_unicode=True).strip(),
        title=f"{title} for {base_name}", description=_description(config), base_model_name=base_name,
        config=config, repo_id=fields.repo_id or "<your-repo-id>", **{
            k: getattr(fields, k) for k in ("base_model_hub_id", "command", "data", "data_recipe", "held_out",
                                            "speedup", "final_train_metrics", "training_paragraph", "limitations")},
        parameters=f"{fields.parameters:,}" if fields.parameters else "a few million",
    )


def _description(config) -> str:
    if config.model_type == "hf_kvspec_medusa":
        return (f"{config.num_heads} Medusa heads (Cai et al., arXiv 2401.10774), {config.num_layers} residual SiLU "
                f"block(s) each, {'sharing the base LM head' if config.share_lm_head else 'each with its own LM head'}"
                ". Head k reads the base model's last hidden state at position t and drafts token t+k+2 (the base "
                "LM head itself gives t+1).")
    if config.model_type == "hf_kvspec_exit_adapter":
        return (f"An exit adapter (Kangaroo, Liu et al. arXiv 2404.18911) for self-speculative decoding: the base "
                f"model's first {config.exit_layer} of {config.base_num_layers} decoder layers, this position-wise "
                f"gated MLP block ({config.intermediate_size} wide, with a residual), then the base model's own final "
                f"norm and LM head draft the next tokens; the remaining layers verify them on the same KV cache.")
    fused = len(config.feature_layers) > 1
    return ("An EAGLE drafter (Li et al., arXiv 2401.15077): one decoder layer of the base architecture over "
            "fc(concat(token embedding, target feature)), sharing the base model's embedding and LM head. "
            + (f"Features fuse base layers {config.feature_layers} (EAGLE-3, arXiv 2503.01840)." if fused else
               "The feature is the base model's final (normalised) hidden state."))


def push_head(head, repo_id: str, card: str, commit_message: str | None = None, private: bool | None = None,
              token: str | bool | None = None, revision: str | None = None) -> str:
    """Upload what ``save_pretrained`` writes (``config.json``, ``model.safetensors``) plus ``README.md`` (the card)
    as one commit; returns the commit URL."""
    from huggingface_hub import CommitOperationAdd, HfApi

    api = HfApi(token=token)
    repo_id = api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model").repo_id
    with tempfile.TemporaryDirectory() as folder:
        head.save_pretrained(folder)
        Path(folder, "README.md").write_text(card)
        operations = [CommitOperationAdd(path_in_repo=path.name, path_or_fileobj=str(path))
                      for path in sorted(Path(folder).iterdir()) if path.is_file()]
        commit = api.create_commit(repo_id=repo_id, operations=operations, repo_type="model", revision=revision,
                                   commit_message=commit_message or f"Upload {type(head).__name__}")
    return commit.commit_url
