"""Compile-once loading of the package's C kernels (``qgemv.c``, ``fgemm.c``) through ctypes.

Boundary: turns a C source shipped in the package into a loaded ``ctypes.CDLL``; knows nothing about tensors or
quantization (``quantized.py`` and ``fp32.py`` own the calls). The shared library is built at first use with the system C
compiler into ``<hf_kvspec cache>/kernels/<name>-<key>.so``, where the key hashes the source, the compiler flags,
the compiler's version and the CPU's model and flags, so a change to any of them builds afresh and a later process
only loads the file. The build writes to a temporary file and renames it into place (atomic on POSIX), so two
processes that build at once never load a half-written library. Beside it, ``<...>.so.sha256`` records the
library's checksum, checked before every load: a truncated or altered file is rebuilt, never mapped (``dlopen`` of
a truncated ELF file can kill the process with SIGBUS).

Flags: ``-O3 -fPIC -shared``, plus ``-mavx2 -mfma -mf16c`` only when ``/proc/cpuinfo`` lists all three (the
vector path); otherwise the portable scalar path; and a library's own ``LIBRARY_FLAGS`` (``-fopenmp`` for
``fgemm``). ``-march=native`` is avoided so the key alone says what the code may use.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

SOURCE_DIR = Path(__file__).resolve().parent
BASE_FLAGS = ("-O3", "-fPIC", "-shared", "-std=c11")
VECTOR_FLAGS = ("-mavx2", "-mfma", "-mf16c")
#: flags one library adds to the machine's (``fgemm`` splits a call's output rows among OpenMP threads; torch's
#: own libgomp, already loaded, serves it)
LIBRARY_FLAGS = {"fgemm": ("-fopenmp",)}
#: every C source's ``QK_ABI_VERSION``: a loaded library reporting another value is rebuilt
ABI_VERSION = 2


class KernelBuildError(RuntimeError):
    """The C kernels cannot be built or loaded here; the message names the fix."""


@dataclass(frozen=True)
class BuildPlan:
    """What to compile and where the result lives."""

    source: Path
    compiler: str
    flags: tuple[str, ...]
    output: Path


def cpu_flags() -> frozenset[str]:
    """The CPU feature flags of ``/proc/cpuinfo`` (empty where there is none, e.g. macOS)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def compile_flags(flags: frozenset[str]) -> tuple[str, ...]:
    vector = {"avx2", "fma", "f16c"} <= flags
    return BASE_FLAGS + (VECTOR_FLAGS if vector else ())


def find_compiler() -> str | None:
    return shutil.which("gcc") or shutil.which("cc")


def _cpu_identity() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return sys.platform
    model = next((line for line in text.splitlines() if line.startswith("model name")), "")
    return model + " " + " ".join(sorted(cpu_flags()))


def _compiler_version(compiler: str) -> str:
    result = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=False)
    return result.stdout.splitlines()[0] if result.stdout else compiler


def plan_build(name: str, cache_root: Path, compiler: str | None = None,
               flags: tuple[str, ...] | None = None) -> BuildPlan:
    """The build of ``<name>.c`` for this machine (``flags``: default ``compile_flags(cpu_flags())`` and the
    library's ``LIBRARY_FLAGS``); raises
    ``KernelBuildError`` when no compiler is found."""
    compiler = compiler or find_compiler()
    if compiler is None:
        raise KernelBuildError(
            "hf_kvspec's CPU kernels (quantized and fp32) are compiled from C at first use, but no C compiler "
            "(gcc or cc) is on PATH. Install one (e.g. `apt-get install gcc`, `conda install gxx`, Xcode command "
            "line tools), or use the pure-torch references: F.linear(x, dequantize(qweight), bias), "
            "F.linear(x, unpack(weight), bias).")
    source = SOURCE_DIR / f"{name}.c"
    flags = compile_flags(cpu_flags()) + LIBRARY_FLAGS.get(name, ()) if flags is None else flags
    digest = hashlib.sha256()
    for part in (source.read_bytes(), " ".join(flags).encode(), _compiler_version(compiler).encode(),
                 _cpu_identity().encode()):
        digest.update(part)
        digest.update(b"\0")
    output = cache_root / "kernels" / f"{name}-{digest.hexdigest()[:16]}.so"
    return BuildPlan(source, compiler, flags, output)


def _checksum_path(output: Path) -> Path:
    return output.with_name(output.name + ".sha256")


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _write_atomically(target: Path, write) -> None:
    """``write(tmp_path)`` then rename the temporary file onto ``target``."""
    fd, tmp = tempfile.mkstemp(suffix=target.suffix, prefix=f".{target.name}-", dir=target.parent)
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def compile_library(plan: BuildPlan) -> None:
    """Compile ``plan.source`` to ``plan.output`` (and its checksum file), each renamed into place."""
    plan.output.parent.mkdir(parents=True, exist_ok=True)
    print(f"hf_kvspec: compiling the C kernels {plan.source.name} (once per machine)...", file=sys.stderr,
          flush=True)

    def build(tmp: str) -> None:
        command = [plan.compiler, *plan.flags, str(plan.source), "-o", tmp]
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise KernelBuildError(f"compiling {plan.source} failed ({' '.join(command)}):\n{result.stderr}")
        _write_atomically(_checksum_path(plan.output), lambda side: Path(side).write_text(_sha256(Path(tmp))))

    _write_atomically(plan.output, build)


def _intact(output: Path) -> bool:
    """True when ``output`` exists and matches the checksum recorded when it was built."""
    try:
        return _checksum_path(output).read_text().strip() == _sha256(output)
    except OSError:
        return False


def _open(path: Path) -> ctypes.CDLL | None:
    """The library at ``path`` if it loads and reports this ABI version, else None."""
    try:
        library = ctypes.CDLL(str(path))
        library.qk_abi_version.restype = ctypes.c_int
        return library if library.qk_abi_version() == ABI_VERSION else None
    except (OSError, AttributeError):
        return None


def load_library(plan: BuildPlan) -> ctypes.CDLL:
    """Load ``plan.output``, compiling it first when missing, altered or unloadable (then rebuilt once)."""
    if _intact(plan.output):
        library = _open(plan.output)
        if library is not None:
            return library
    plan.output.unlink(missing_ok=True)
    compile_library(plan)
    library = _open(plan.output)
    if library is None:
        raise KernelBuildError(f"{plan.output} was just built but does not load; delete it and retry, or report "
                               f"the compiler ({plan.compiler}) and flags {plan.flags}.")
    return library


@functools.cache
def shared_library(name: str, cache_root: Path) -> ctypes.CDLL:
    """The loaded ``<name>.c`` library for this process (built at most once per machine)."""
    return load_library(plan_build(name, cache_root))
