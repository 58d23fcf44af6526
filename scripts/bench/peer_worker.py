"""One peer of ``benchmark.py peers``, driven over a pipe: runs inside the peer's own interpreter.

Boundary: this file imports only the standard library and, lazily, the one peer package it is asked to load
(``llama_cpp`` or ``openvino_genai``); never torch, transformers or hf_kvspec, so it runs in a virtual environment
that holds nothing but the peer. ``bench/peer_client.py`` starts it and speaks the protocol below.

Protocol: one JSON object per line on stdin, one JSON reply per line on stdout, in order.

    {"op": "load", "backend": "llama.cpp" | "openvino" | "echo", "model": PATH, "threads": 1,
     "options": {"lookup_tokens": 2, "max_ngram": 2}}          (options empty: plain decoding)
        -> {"ok": true, "info": {"version": "...", ...}}
    {"op": "generate", "ids": [int, ...], "max_new_tokens": N, "eos": [int, ...]}
        -> {"ok": true, "tokens": [int, ...], "eos": bool, "ttft_s": float, "seconds": float}
    any failure -> {"ok": false, "error": "ExceptionName: message"}; end of stdin -> the worker exits.

``tokens`` are the new tokens before the first end-of-sequence id; ``eos`` says whether one was generated.
``seconds`` is the wall time of the whole call (prefill included); ``ttft_s`` the time to the first new token.
Greedy decoding, no repetition penalty, the prompt fed as token ids (the caller applied the chat template).

Peer libraries print to file descriptor 1 from C code; the replies go to a private duplicate of it, and fd 1 is
pointed at stderr, so nothing but replies reaches the pipe.
"""

from __future__ import annotations

import json
import os
import sys
import time

N_CTX = 2048  # prompt + new tokens at most


class EchoBackend:
    """A peer that needs no package: new token i is ``ids[-1] + 1 + i`` (an EOS id stops it). For the protocol's
    tests and a dry run of the benchmark's harness (``--peers echo``)."""

    def __init__(self, model: str, threads: int, options: dict):
        self.info = {"version": "echo", "model": model, "threads": threads, "options": options}

    def generate(self, ids: list[int], max_new_tokens: int, eos: list[int]) -> dict:
        start = time.perf_counter()
        tokens = []
        for i in range(max_new_tokens):
            token = ids[-1] + 1 + i
            if token in eos:
                return _result(tokens, True, start, start)
            tokens.append(token)
        return _result(tokens, False, start, start)


class LlamaCppBackend:
    """llama.cpp through llama-cpp-python's ``Llama.generate`` (``LlamaPromptLookupDecoding`` when options ask)."""

    def __init__(self, model: str, threads: int, options: dict):
        import llama_cpp

        draft = None
        if options:
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

            draft = LlamaPromptLookupDecoding(num_pred_tokens=options["lookup_tokens"],
                                              max_ngram_size=options["max_ngram"])
        # f32 KV cache (llama.cpp's default is f16): the same arithmetic as the other systems. A draft model makes
        # llama-cpp-python keep every position's logits (n_ctx x vocab floats): n_ctx stays modest
        self.llm = llama_cpp.Llama(model_path=model, n_ctx=N_CTX, n_threads=threads, n_threads_batch=threads,
                                   type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32, draft_model=draft,
                                   verbose=False)
        self.info = {"version": llama_cpp.__version__, "model": model, "threads": threads, "options": options}

    def generate(self, ids: list[int], max_new_tokens: int, eos: list[int]) -> dict:
        self.llm.reset()  # no prefix reuse from the previous call: every call pays its prefill, as ours does
        start = time.perf_counter()
        first, tokens = None, []
        for token in self.llm.generate(ids, temp=0.0, top_k=1, repeat_penalty=1.0, reset=True):
            first = first or time.perf_counter()
            if token in eos:
                return _result(tokens, True, start, first)
            tokens.append(token)
            if len(tokens) == max_new_tokens:
                break
        return _result(tokens, False, start, first)


class OpenVinoBackend:
    """OpenVINO GenAI's ``LLMPipeline`` on CPU in fp32 (``prompt_lookup=True`` when options ask)."""

    def __init__(self, model: str, threads: int, options: dict):
        import openvino_genai

        # f32 inference and KV cache: the same arithmetic as the other systems (the CPU plugin would otherwise
        # pick bf16 where the CPU has it and a u8 KV cache)
        properties = {"INFERENCE_NUM_THREADS": threads, "INFERENCE_PRECISION_HINT": "f32",
                      "KV_CACHE_PRECISION": "f32"}
        if options:
            properties["prompt_lookup"] = True
        # as the pipeline's own latency-oriented default (one prefill chunk, 1 GB of KV blocks) but without prefix
        # caching: every call pays its whole prefill, as in the other systems (chat prompts share a system prompt)
        scheduler = openvino_genai.SchedulerConfig()
        scheduler.cache_size, scheduler.max_num_batched_tokens, scheduler.enable_prefix_caching = 1, N_CTX, False
        properties["scheduler_config"] = scheduler
        self.genai = openvino_genai
        self.pipe = openvino_genai.LLMPipeline(model, "CPU", **properties)
        self.options = options
        self.info = {"version": openvino_genai.__version__, "model": model, "threads": threads, "options": options}

    def generate(self, ids: list[int], max_new_tokens: int, eos: list[int]) -> dict:
        import openvino

        config = self.genai.GenerationConfig()
        config.max_new_tokens, config.do_sample = max_new_tokens, False
        config.stop_token_ids = set(eos)
        if self.options:
            config.num_assistant_tokens = self.options["lookup_tokens"]
            config.max_ngram_size = self.options["max_ngram"]
        inputs = self.genai.TokenizedInputs(openvino.Tensor(_int64_rows([ids])),
                                            openvino.Tensor(_int64_rows([[1] * len(ids)])))
        start = time.perf_counter()
        result = self.pipe.generate(inputs, config)
        end = time.perf_counter()
        tokens = list(result.tokens[0])
        stopped = bool(tokens) and tokens[-1] in eos
        if stopped:
            tokens = tokens[:-1]
        stopped = stopped or len(tokens) < max_new_tokens  # the pipeline may drop the stop token itself
        return {"ok": True, "tokens": tokens, "eos": stopped, "seconds": end - start,
                "ttft_s": result.perf_metrics.get_ttft().mean / 1e3}


def _int64_rows(rows: list[list[int]]):
    import numpy

    return numpy.asarray(rows, dtype=numpy.int64)


def _result(tokens: list[int], stopped: bool, start: float, first: float | None) -> dict:
    end = time.perf_counter()
    return {"ok": True, "tokens": tokens, "eos": stopped, "seconds": end - start,
            "ttft_s": (first or end) - start}


BACKENDS = {"llama.cpp": LlamaCppBackend, "openvino": OpenVinoBackend, "echo": EchoBackend}


def serve(requests, replies) -> None:
    """Answer each request line of ``requests`` with one line on ``replies`` until end of input."""
    backend = None
    for line in requests:
        if not line.strip():
            continue
        try:
            request = json.loads(line)
            if request["op"] == "load":
                backend = BACKENDS[request["backend"]](request["model"], request["threads"], request["options"])
                reply = {"ok": True, "info": backend.info}
            elif request["op"] == "generate":
                if backend is None:
                    raise RuntimeError("generate before load")
                reply = backend.generate(request["ids"], request["max_new_tokens"], request["eos"])
            else:
                raise ValueError(f"unknown op {request['op']!r}")
        except Exception as error:  # reported to the caller, which raises it with the peer's name
            reply = {"ok": False, "error": f"{type(error).__name__}: {error}"}
        replies.write(json.dumps(reply) + "\n")
        replies.flush()


def main() -> None:
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # C code printing to stdout now prints to stderr
    sys.stdout = sys.stderr
    serve(sys.stdin, replies)


if __name__ == "__main__":
    main()
