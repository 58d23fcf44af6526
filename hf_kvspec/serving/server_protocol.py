"""The OpenAI wire format of ``hf-kvspec serve``: request bodies of ``/v1/completions`` and
``/v1/chat/completions`` checked field by field into a typed ``GenerationParams``, and the response, chunk and
error bodies built from plain values.

Boundary: JSON in, dicts out; no engine, no tokenizer, no HTTP. A bad body raises ``BadRequest`` naming the
field (``param``), which the server turns into a 400 with an OpenAI-style error body.

Deviations from the OpenAI API, all refused by name rather than ignored: no ``suffix``, ``best_of``, penalties, ``logit_bias`` or tools. ``response_format``
(``json_object``, ``json_schema``) is compiled here into a grammar (``hf_kvspec.grammar``, llguidance) that masks
every token the target scores, drafts' included.
Log-probabilities (chat ``logprobs`` / ``top_logprobs``, completions ``logprobs``: 0..20 alternatives, where
OpenAI's completions stop at 5) are the target's after the request's temperature and top-p (``logprobs.py``);
completions' ``echo`` returns the prompt before the completion, with the model's log-probability of each prompt
token given the ones before it (the first has none: null), and allows ``max_tokens: 0`` (score only);
``-inf`` (a token top-p removed) is sent as ``-9999.0``, JSON having no infinity. ``temperature = 0`` is greedy decoding, and so is a temperature below 1e-5 (the engine's
``GREEDY_BELOW_TEMPERATURE``: dividing by less overflows the scores). ``seed`` is in ``0 .. 2**64 - 1``; with
``n > 1``, choice ``i`` samples with seed ``(seed + i) mod 2**64``, so each choice is reproducible on its own.
Chat roles are ``system``, ``developer``, ``user`` and ``assistant``.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass

MAX_N = 16  # choices per request
MAX_STOP = 4  # stop strings per request (OpenAI's limit)
SEED_RANGE = 2**64  # torch.Generator seeds: 0 .. 2**64 - 1
ROLES = ("system", "developer", "user", "assistant")
DEFAULT_MAX_TOKENS = {"completion": 16, "chat": 256}  # OpenAI's legacy completions default is 16 tokens


class BadRequest(ValueError):
    """A request the server refuses with 400; ``param`` names the offending field (or None)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


@dataclass(frozen=True)
class GenerationParams:
    """One checked request (``kind``: ``"completion"`` or ``"chat"``)."""

    kind: str
    # completion: the prompts (each text or ids; a batch is one request whose choice p * n + i is prompt p's
    # choice i); chat: the messages
    prompt: tuple[str | list[int], ...] | list[dict]
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False  # stream_options.continuous_usage_stats (vLLM's): usage in every chunk
    ignore_eos: bool = False  # vLLM's extension: generate past end-of-sequence tokens, up to max_tokens
    model: str | None = None
    cache_salt: str | None = None  # the tenant: prefix blocks and suffix-pool drafts are shared within one salt only
    logprobs: int | None = None  # alternatives per output token (0..20); None: no log-probabilities
    echo: bool = False  # completions: the prompt's text (and log-probabilities) before the completion
    grammar: str | None = None  # response_format compiled (``hf_kvspec.grammar.compile_grammar``); None: free text

    @property
    def prompt_field(self) -> str:
        return "messages" if self.kind == "chat" else "prompt"

    @property
    def prompts(self) -> tuple:
        """The request's prompts: a completions batch's, or the chat's one list of messages."""
        return (self.prompt,) if self.kind == "chat" else self.prompt

    def engine_kwargs(self, choice: int) -> dict:
        """``Engine.add_request`` keywords for choice ``choice``."""
        sampled = self.temperature > 0
        return {"max_new_tokens": self.max_tokens, "do_sample": sampled,
                "temperature": self.temperature if sampled else 1.0, "top_p": self.top_p,
                "seed": None if self.seed is None else (self.seed + choice) % SEED_RANGE, "stop_strings": self.stop,
                "salt": self.cache_salt, "logprobs": self.logprobs, **({"eos_token_id": []} if self.ignore_eos else {})}


# ---- parsing ---------------------------------------------------------------------------------------------
_IGNORED = {"user", "metadata", "store"}  # accepted and ignored: they do not change the output
_COMMON = {"model", "max_tokens", "temperature", "top_p", "seed", "stop", "n", "stream", "stream_options",
           "cache_salt", "logprobs", "response_format", "ignore_eos"}
_FIELDS = {"completion": _COMMON | {"prompt", "echo"}, "chat": _COMMON | {"messages", "max_completion_tokens", "top_logprobs"}}
MAX_LOGPROBS = 20  # alternatives per token (logprobs.MAX_TOP_LOGPROBS)
NEG_INF = -9999.0  # what -inf is sent as (vLLM's choice too)


def parse_request(body: bytes, kind: str) -> GenerationParams:
    """Check a request body field by field; raises ``BadRequest`` naming the first bad field."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as err:
        raise BadRequest(f"The body is not valid JSON: {err}.", code="invalid_json") from None
    if not isinstance(data, dict):
        raise BadRequest("The body must be a JSON object.", code="invalid_json")
    for name in data:
        if name not in _FIELDS[kind] | _IGNORED:
            raise BadRequest(f"Unrecognized or unsupported request argument: {name!r}.", param=name,
                             code="unsupported_parameter")
    data = {name: value for name, value in data.items() if value is not None and name not in _IGNORED}
    echo = kind == "completion" and _boolean(data, "echo", False)
    max_tokens = _max_tokens(data, kind, echo)
    temperature = _number(data, "temperature", 1.0, lo=0.0, hi=2.0)
    top_p = _number(data, "top_p", 1.0, lo=0.0, hi=1.0, lo_open=True)
    return GenerationParams(
        kind=kind, prompt=_messages(data) if kind == "chat" else _prompt(data), max_tokens=max_tokens,
        temperature=temperature, top_p=top_p, seed=_integer(data, "seed", None, lo=0, hi=SEED_RANGE - 1),
        stop=_stop(data),
        n=_integer(data, "n", 1, lo=1, hi=MAX_N), stream=_boolean(data, "stream", False),
        include_usage=_stream_options(data, "include_usage"),
        continuous_usage=_stream_options(data, "continuous_usage_stats"),
        ignore_eos=_boolean(data, "ignore_eos", False), model=_string(data, "model", None), cache_salt=_salt(data),
        logprobs=_chat_logprobs(data) if kind == "chat" else _integer(data, "logprobs", None, lo=0, hi=MAX_LOGPROBS),
        echo=echo, grammar=_response_format(data))


def _fail(name: str, expected: str, value) -> BadRequest:
    return BadRequest(f"{name!r} must be {expected}, got {json.dumps(value)[:80]}.", param=name,
                      code="invalid_value")


def _integer(data: Mapping, name: str, default, lo: int | None = None, hi: int | None = None):
    value = data.get(name, default)
    if value is default:
        return value
    if isinstance(value, bool) or not isinstance(value, int):
        raise _fail(name, "an integer", value)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        bounds = f">= {lo}" if hi is None else f"between {lo} and {hi}"
        raise _fail(name, f"an integer {bounds}", value)
    return value


def _number(data: Mapping, name: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    value = data.get(name, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _fail(name, "a number", value)
    if value > hi or value < lo or (lo_open and value == lo):
        raise _fail(name, f"a number in {'(' if lo_open else '['}{lo}, {hi}]", value)
    return float(value)


def _boolean(data: Mapping, name: str, default: bool) -> bool:
    value = data.get(name, default)
    if not isinstance(value, bool):
        raise _fail(name, "true or false", value)
    return value


def _string(data: Mapping, name: str, default):
    value = data.get(name, default)
    if value is not default and not isinstance(value, str):
        raise _fail(name, "a string", value)
    return value


def _salt(data: Mapping) -> str | None:
    """``cache_salt`` (vLLM's name for it): a non-empty string naming the request's tenant."""
    salt = _string(data, "cache_salt", None)
    if salt is not None and not salt:
        raise _fail("cache_salt", "a non-empty string (the tenant's secret)", salt)
    return salt


def _response_format(data: Mapping) -> str | None:
    """``response_format``: ``{"type": "text"}`` (free text), ``{"type": "json_object"}`` or ``{"type":
    "json_schema", "json_schema": {"name", "schema", "strict"?, "description"?}}``, compiled to a grammar."""
    value = data.get("response_format")
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in ("text", "json_object", "json_schema") or (kind != "json_schema" and set(value) != {"type"}):
        raise _fail("response_format", '{"type": "text"}, {"type": "json_object"} or {"type": "json_schema", '
                    '"json_schema": {"name": ..., "schema": {...}}}', value)
    if kind == "text":
        return None
    spec = value.get("json_schema")
    if kind == "json_schema" and (not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict)
                                  or set(spec) - {"name", "schema", "strict", "description"}):
        raise _fail("response_format.json_schema", "an object with a 'schema' object (and 'name', 'strict', "
                    "'description')", spec)
    from hf_kvspec.grammar import compile_grammar

    try:
        if kind == "json_object":
            return compile_grammar(json_object=True)
        return compile_grammar(json_schema=spec["schema"])
    except (ValueError, ImportError) as err:
        raise BadRequest(f"'response_format' cannot be served: {err}", param="response_format",
                         code="invalid_value") from None


def _chat_logprobs(data: Mapping) -> int | None:
    """Chat: ``logprobs: true`` turns them on, ``top_logprobs`` (0..20, only with it) asks for alternatives."""
    wanted = _boolean(data, "logprobs", False)
    top = _integer(data, "top_logprobs", None, lo=0, hi=MAX_LOGPROBS)
    if top is not None and not wanted:
        raise BadRequest("'top_logprobs' needs 'logprobs': true.", param="top_logprobs", code="invalid_value")
    return (top or 0) if wanted else None


def _max_tokens(data: Mapping, kind: str, echo: bool) -> int:
    """``max_completion_tokens`` wins over ``max_tokens`` (chat), but each given one must be valid; 0 only with
    ``echo`` (the prompt scored, nothing generated)."""
    given = _integer(data, "max_tokens", DEFAULT_MAX_TOKENS[kind], lo=0 if echo else 1)
    return _integer(data, "max_completion_tokens", given, lo=1)


def _stop(data: Mapping) -> tuple[str, ...]:
    value = data.get("stop", [])
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > MAX_STOP:
        raise _fail("stop", f"a non-empty string or a list of at most {MAX_STOP} non-empty strings", value)
    return tuple(stops)


def _stream_options(data: Mapping, name: str) -> bool:
    """One of ``stream_options``' flags: ``include_usage`` (OpenAI's: a last chunk with the usage) or
    ``continuous_usage_stats`` (vLLM's: the usage so far in every chunk)."""
    options = data.get("stream_options", {})
    if not isinstance(options, dict) or set(options) - {"include_usage", "continuous_usage_stats"}:
        raise _fail("stream_options", 'an object {"include_usage": bool, "continuous_usage_stats": bool}', options)
    if options and not data.get("stream", False):
        raise BadRequest("'stream_options' is only allowed with 'stream': true.", param="stream_options",
                         code="invalid_value")
    value = options.get(name, False)
    if not isinstance(value, bool):
        raise _fail(f"stream_options.{name}", "true or false", value)
    return value


MAX_PROMPTS = 64  # prompts in one completions request


def _prompt(data: Mapping) -> tuple[str | list[int], ...]:
    """A string, a list of token ids, or a batch: a list of strings or of token-id lists."""
    if "prompt" not in data:
        raise BadRequest("'prompt' is required.", param="prompt", code="missing_required_parameter")
    prompt = data["prompt"]
    batch = prompt if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt) \
        else [prompt]
    if len(batch) > MAX_PROMPTS:
        raise _fail("prompt", f"at most {MAX_PROMPTS} prompts", len(batch))
    for item in batch:
        if not (isinstance(item, str) and item) and not (
                isinstance(item, list) and item and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                         for t in item)):
            raise _fail("prompt", "a non-empty string, a non-empty list of token ids, or a list of those", prompt)
    return tuple(item if isinstance(item, str) else list(item) for item in batch)


def _messages(data: Mapping) -> list[dict]:
    messages = data.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _fail("messages", "a non-empty list of {role, content} objects", messages)
    return [_message(message, f"messages[{i}]") for i, message in enumerate(messages)]


def _message(message, where: str) -> dict:
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise _fail(where, "an object with a string 'role'", message)
    if message["role"] not in ROLES:
        raise _fail(f"{where}.role", f"one of {', '.join(ROLES)}", message["role"])
    content = message.get("content")
    if isinstance(content, list):  # content parts: text only
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in content):
            raise _fail(f"{where}.content", "a string or a list of text parts", content)
        content = "".join(part["text"] for part in content)
    if not isinstance(content, str):
        raise _fail(f"{where}.content", "a string or a list of text parts", content)
    return {"role": message["role"], "content": content}


# ---- responses -------------------------------------------------------------------------------------------
def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def new_response_id(kind: str) -> str:
    return f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"


def finish_reason_name(reason) -> str | None:
    """The engine's finish reason as OpenAI names it (EOS and stop strings are both ``"stop"``)."""
    if reason is None:
        return None
    return "length" if reason.value == "length" else "stop"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def response_body(params: GenerationParams, response_id: str, model: str, choices: list[dict], usage_: dict,
                  extension: list[dict]) -> dict:
    """A whole (non-streamed) response; ``choices`` hold ``index``, ``text``, ``finish_reason``."""
    if params.kind == "chat":
        choices = [{"index": c["index"], "message": {"role": "assistant", "content": c["text"]},
                    "logprobs": c.get("logprobs"), "finish_reason": c["finish_reason"]} for c in choices]
        obj = "chat.completion"
    else:
        choices = [{"index": c["index"], "text": c["text"], "logprobs": c.get("logprobs"),
                    "finish_reason": c["finish_reason"]} for c in choices]
        obj = "text_completion"
    return {"id": response_id, "object": obj, "created": int(time.time()), "model": model, "choices": choices,
            "usage": usage_, "kvspec": {"choices": extension}}


def chunk_body(params: GenerationParams, response_id: str, model: str, index: int, text: str | None,
               finish_reason: str | None = None, first: bool = False, extension: dict | None = None,
               logprobs: dict | None = None, usage_: dict | None = None) -> dict:
    """One streamed chunk for one choice; the chat form's first chunk carries the assistant role. ``logprobs``:
    the ``logprobs_body`` of the tokens this chunk reports."""
    if params.kind == "chat":
        delta = {"role": "assistant", "content": ""} if first else ({} if text is None else {"content": text})
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
        obj = "text_completion"
    body = {"id": response_id, "object": obj, "created": int(time.time()), "model": model, "choices": [choice]}
    if extension is not None:
        body["kvspec"] = extension
    if usage_ is not None:  # stream_options.continuous_usage_stats
        body["usage"] = usage_
    return body


def logprobs_body(kind: str, decoded: list) -> dict:
    """The ``logprobs`` of a choice (or chunk) from its tokens' ``server_text.DecodedLogprob``s: chat's
    ``{"content": [{token, logprob, bytes, top_logprobs}]}``, or the completions form ``{tokens, token_logprobs,
    top_logprobs, text_offset}`` whose ``top_logprobs`` hold the alternatives and the chosen token (OpenAI: up to
    ``logprobs + 1`` entries)."""
    if kind == "chat":
        return {"content": [{**_token_entry(d.text, d.logprob),
                             "top_logprobs": [_token_entry(text, value) for text, value in d.top]} for d in decoded]}
    return {"tokens": [d.text for d in decoded],
            "token_logprobs": [None if d.logprob is None else _finite(d.logprob) for d in decoded],
            "top_logprobs": [None if d.logprob is None else _completion_top(d) for d in decoded],
            "text_offset": [d.offset for d in decoded]}


def _completion_top(decoded) -> dict[str, float]:
    """Alternatives, most likely first, then the chosen token if it is not among them (a text two tokens share
    keeps the likelier value)."""
    top: dict[str, float] = {}
    for text, value in (*decoded.top, (decoded.text, decoded.logprob)):
        top.setdefault(text, _finite(value))
    return top


def _token_entry(text: str, logprob: float) -> dict:
    return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode("utf-8"))}


def _finite(logprob: float) -> float:
    return logprob if logprob > NEG_INF else NEG_INF


def usage_chunk(params: GenerationParams, response_id: str, model: str, usage_: dict) -> dict:
    """The last chunk of a stream with ``stream_options.include_usage``: no choices, the usage."""
    obj = "chat.completion.chunk" if params.kind == "chat" else "text_completion"
    return {"id": response_id, "object": obj, "created": int(time.time()), "model": model, "choices": [],
            "usage": usage_}


def sse(body: dict | str) -> str:
    """One server-sent event (``data: ...`` and a blank line)."""
    return f"data: {body if isinstance(body, str) else json.dumps(body)}\n\n"
