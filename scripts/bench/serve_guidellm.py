"""``benchmark.py serve --client guidellm``: the servers measured by GuideLLM (the standard serving benchmark)
instead of our own client.

    python scripts/benchmark.py --threads 1 serve --client guidellm --peer transformers --assistants auto \\
        --concurrency 1,4,16 [--guidellm-requests 8,16,32] [--slo-ttft-ms 2000 --slo-itl-ms 150]

GuideLLM (``guidellm`` 0.8.1, its own venv made on first use by ``peer_envs.GUIDELLM``) runs one benchmark per
profile against each server in turn: ``synchronous`` for C = 1, ``concurrent`` with C streams otherwise; synthetic
prompts of 128 tokens (its own generator, the bundled tokenizer folder, no Hub), 64 output tokens each, a bounded
number of requests per profile after two warm-up requests. Every answer is exactly 64 tokens: ours gets
GuideLLM's ``ignore_eos``, transformers serve (which refuses that field) ``generation_config`` without an
end-of-sequence token.

Figures per server and profile, read from GuideLLM's JSON report: output tokens/s (GuideLLM's: output tokens over
the benchmark's duration), TTFT p50/p99, ITL p50/p99 (GuideLLM's inter-token latency: (last token - first token) /
(tokens - 1) per request), TPOT p50 (GuideLLM's definition: (last token - request start) / tokens, so TTFT is in
it), errored requests, and goodput at the stated SLOs: output tokens/s of the requests whose TTFT and ITL both met
them. Reports per run: ``benchmarks/results/<name>-guidellm/<server>.json`` (not committed).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from bench import peer_envs
from bench.harness import RESULTS_DIR, Report, load_averages
from bench.serve_servers import SERVED_NAME, ServerProcess, ServerSpec

COLUMNS = ["server", "profile", "requests", "output_tokens", "tok_per_s", "vs_transformers", "vs_ours", "ttft_p50_ms",
           "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "tpot_p50_ms", "goodput_tok_per_s", "met_slo", "errored"]
PROMPT_TOKENS, OUTPUT_TOKENS, WARMUP = 128, 64, 2


def add_arguments(parser) -> None:
    parser.add_argument("--guidellm-requests", default="8,16,32",
                        help="with --client guidellm: requests per profile, one per --concurrency value")
    parser.add_argument("--slo-ttft-ms", type=float, default=2000.0, help="goodput: TTFT at most this")
    parser.add_argument("--slo-itl-ms", type=float, default=150.0, help="goodput: inter-token latency at most this")


def counts(args, levels: list[int]) -> list[int]:
    values = [int(v) for v in args.guidellm_requests.split(",") if v.strip()]
    if len(values) != len(levels) or min(values) < 1:
        raise ValueError(f"--guidellm-requests needs one count >= 1 per --concurrency value ({len(levels)}), got "
                         f"{args.guidellm_requests!r}")
    return values


def command(python: Path, target: str, spec: ServerSpec, folder: Path, level: int, requests: int,
            out: Path) -> list[str]:
    """The ``guidellm run`` of one profile against ``target``."""
    transformers = spec.name.startswith("transformers/")
    backend = {"kind": "openai_http", "target": target, "model": str(folder) if transformers else SERVED_NAME}
    data = f"kind=synthetic_text,prompt_tokens={PROMPT_TOKENS}"
    if transformers:  # it refuses ignore_eos: max_tokens, and no end-of-sequence token in its generation config
        backend |= {"max_tokens": OUTPUT_TOKENS,
                    "extras": {"body": {"generation_config": json.dumps({"eos_token_id": -1})}}}
    else:
        data += f",output_tokens={OUTPUT_TOKENS}"
    profile = {"kind": "synchronous"} if level == 1 else {"kind": "concurrent", "streams": level}
    profile["warmup"] = {"value": WARMUP, "mode": "requests"}
    return [str(python.parent / "guidellm"), "run", "--backend", json.dumps(backend), "--profile", json.dumps(profile),
            "--constraint", f"kind=max_requests,count={requests + WARMUP}",
            "--tokenizer", f"kind=huggingface_auto,model={folder}", "--data", data,
            "--output", f"kind=json,path={out}", "--disable-progress"]


def summarise(report: dict, slo_ttft_ms: float, slo_itl_ms: float) -> dict:
    """One profile's figures from a GuideLLM JSON report (``benchmarks[0]``; warm-up requests left out)."""
    bench = report["benchmarks"][0]
    metrics = bench["metrics"]
    start, duration = bench["start_time"], bench["duration"]
    done = [r for r in bench["requests"]["successful"] if r["request_start_time"] >= start]
    met = [r for r in done if r["time_to_first_token_ms"] <= slo_ttft_ms and r["inter_token_latency_ms"] <= slo_itl_ms]

    def pct(name: str, p: str) -> float:
        return round(metrics[name]["successful"]["percentiles"][p], 1)

    return {"requests": len(done), "output_tokens": sum(r["output_tokens"] for r in done),
            "tok_per_s": round(metrics["output_tokens_per_second"]["successful"]["mean"], 2),
            "ttft_p50_ms": pct("time_to_first_token_ms", "p50"), "ttft_p99_ms": pct("time_to_first_token_ms", "p99"),
            "itl_p50_ms": pct("inter_token_latency_ms", "p50"), "itl_p99_ms": pct("inter_token_latency_ms", "p99"),
            "tpot_p50_ms": pct("time_per_output_token_ms", "p50"),
            "goodput_tok_per_s": round(sum(r["output_tokens"] for r in met) / duration, 2),
            "met_slo": f"{len(met)}/{len(done)}", "errored": metrics["request_totals"]["errored"]}


def measure(spec: ServerSpec, python: Path, folder: Path, levels: list[int], requests: list[int], args) -> dict:
    """Start ``spec``, run GuideLLM at every profile, stop it: ``{level: summary}``."""
    out_dir = RESULTS_DIR / f"{args.name}-guidellm"
    log = RESULTS_DIR / f"{args.name}-logs" / f"{spec.name.replace('/', '_')}.log"
    print(f"starting {spec.name} (log: {log})", flush=True)
    results = {}
    with ServerProcess(spec, log) as server:
        print(f"  {spec.name} ready in {server.wait_ready(args.startup_timeout):.0f} s", flush=True)
        for level, count in zip(levels, requests):
            out = out_dir / f"{spec.name.replace('/', '_')}.c{level}.json"
            out.parent.mkdir(parents=True, exist_ok=True)
            run = subprocess.run(command(python, server.base_url, spec, folder, level, count, out),
                                 capture_output=True, text=True, env=_client_env())
            if run.returncode != 0 or not out.is_file():
                raise RuntimeError(f"guidellm failed against {spec.name} at C = {level}:\n{run.stderr[-2000:]}")
            summary = summarise(json.loads(out.read_text()), args.slo_ttft_ms, args.slo_itl_ms)
            if summary["errored"]:
                raise RuntimeError(f"{spec.name} answered {summary['errored']} GuideLLM requests with errors at "
                                   f"C = {level}; see {out}")
            results[level] = summary
            print(f"  {spec.name} C={level}: {summary['tok_per_s']} tok/s, TTFT p50 {summary['ttft_p50_ms']} ms, "
                  f"ITL p50 {summary['itl_p50_ms']} ms", flush=True)
    return results


def _client_env() -> dict:
    """GuideLLM's environment: its own venv's packages (not this checkout's), one thread, no Hub."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return env | {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def run(args, servers: list[ServerSpec], levels: list[int], folder: Path) -> None:
    requests = counts(args, levels)
    python = peer_envs.ensure_venv(peer_envs.GUIDELLM, peer_envs.peers_root())
    before = load_averages()
    results = {spec.name: measure(spec, python, folder, levels, requests, args) for spec in servers}
    report = Report(args.name, "GuideLLM against hf-kvspec serve and transformers serve --continuous-batching",
                    COLUMNS, settings={"concurrency": levels, "requests": requests, "prompt_tokens": PROMPT_TOKENS,
                                       "output_tokens": OUTPUT_TOKENS, "slo_ttft_ms": args.slo_ttft_ms,
                                       "slo_itl_ms": args.slo_itl_ms, "guidellm": peer_envs.GUIDELLM_VERSION,
                                       "servers": list(results)})
    for name, per_level in results.items():
        for level, summary in per_level.items():
            base = results.get("transformers/cb", {}).get(level)
            ours = results.get("ours/plain", {}).get(level)
            report.add(server=name, profile="synchronous" if level == 1 else f"concurrent {level}", **summary,
                       vs_transformers=round(summary["tok_per_s"] / base["tok_per_s"], 2) if base else None,
                       vs_ours=round(summary["tok_per_s"] / ours["tok_per_s"], 2) if ours else None)
    report.notes += [f"Load average before: {before}; after: {load_averages()}.",
                     "tok_per_s: GuideLLM's output tokens per second; TTFT, ITL (inter-token latency) and TPOT "
                     "(last token - request start, over the tokens: TTFT included) in ms as GuideLLM measures them; "
                     f"goodput: output tokens/s of the requests with TTFT <= {args.slo_ttft_ms:g} ms and ITL <= "
                     f"{args.slo_itl_ms:g} ms; every answer is exactly {OUTPUT_TOKENS} tokens (module docstring)."]
    report.write(RESULTS_DIR)
