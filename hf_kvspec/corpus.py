"""Real text available offline, as ``datasets.Dataset`` objects, for perplexity and drafter training.

Boundary: finds or fetches raw text files and hands them to ``datasets.load_dataset("text")``; knows
nothing about tokenization or models.

Corpora (no Hugging Face Hub needed):
    ``python-docs``   English reST sources of the Python 3.11 documentation, from Debian's ``python3.11-doc``
                      package (fetched once with ``apt-get download`` and unpacked with ``dpkg-deb -x``; ~500 files,
                      11 MB of text).
    ``python-stdlib`` the Python standard library's own ``.py`` sources on this machine (code).

Splits are stable across machines: a file goes to ``test`` when the first byte of the SHA-256 of its relative
path falls under ``test_fraction``; ``train`` gets the rest.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path

from hf_kvspec.models import cache_dir as _cache_root


@dataclass(frozen=True)
class Corpus:
    name: str
    description: str
    debian_package: str | None  # None: files already on this machine
    pattern: str  # glob under the root
    license: str


CORPORA: dict[str, Corpus] = {
    "python-docs": Corpus(
        name="python-docs",
        description="Python 3.11 documentation, reST sources (English prose with code samples)",
        debian_package="python3.11-doc",
        pattern="usr/share/doc/python3.11/html/_sources/**/*.rst.txt",
        license="PSF-2.0",
    ),
    "python-stdlib": Corpus(
        name="python-stdlib",
        description="Python standard library sources (code)",
        debian_package=None,
        pattern="**/*.py",
        license="PSF-2.0",
    ),
}
SPLITS = ("train", "test", "all")


class CorpusUnavailableError(RuntimeError):
    """A corpus cannot be fetched on this machine."""


def _spec(name: str) -> Corpus:
    if name not in CORPORA:
        raise ValueError(f"Unknown corpus {name!r}; known: {', '.join(CORPORA)}.")
    return CORPORA[name]


def _fetch_debian(package: str, target: Path) -> None:
    """Download a .deb with apt-get and unpack it with dpkg-deb into ``target`` (no install, no root needed)."""
    for tool in ("apt-get", "dpkg-deb"):
        if shutil.which(tool) is None:
            raise CorpusUnavailableError(
                f"Fetching the {package!r} corpus needs `{tool}` (Debian/Ubuntu). Pass your own files instead, e.g. "
                "datasets.load_dataset('text', data_files=[...])."
            )
    with tempfile.TemporaryDirectory() as tmp:
        result = subprocess.run(["apt-get", "download", package], cwd=tmp, capture_output=True, text=True)
        debs = list(Path(tmp).glob("*.deb"))
        if result.returncode != 0 or not debs:
            raise CorpusUnavailableError(
                f"`apt-get download {package}` failed (exit {result.returncode}): {result.stderr.strip()[-500:]}"
            )
        staging = target.with_name(target.name + ".tmp")
        shutil.rmtree(staging, ignore_errors=True)
        subprocess.run(["dpkg-deb", "-x", str(debs[0]), str(staging)], check=True)
        staging.rename(target)  # atomic: never a half-unpacked corpus


def corpus_root(name: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """Directory holding the corpus files, fetching them on first use."""
    spec = _spec(name)
    if spec.debian_package is None:
        return Path(sysconfig.get_paths()["stdlib"])
    root = _cache_root(cache_dir) / "corpora" / name
    if not root.is_dir():
        root.parent.mkdir(parents=True, exist_ok=True)
        _fetch_debian(spec.debian_package, root)
    return root


def _in_test_split(relative_path: str, test_fraction: float) -> bool:
    first_byte = hashlib.sha256(relative_path.encode()).digest()[0]
    return first_byte < round(256 * test_fraction)


def corpus_files(name: str, split: str = "train", test_fraction: float = 0.1,
                 cache_dir: str | os.PathLike | None = None) -> list[Path]:
    """Sorted file paths of one split of a corpus."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}.")
    root = corpus_root(name, cache_dir)
    skip = {"site-packages", "test", "tests", "idle_test"}  # third-party code and encoding-torture test data
    files = sorted(p for p in root.glob(_spec(name).pattern) if p.is_file() and not skip & set(p.parts))
    if split == "all":
        return files
    want_test = split == "test"
    return [p for p in files if _in_test_split(p.relative_to(root).as_posix(), test_fraction) == want_test]


def load_text_corpus(name: str = "python-docs", split: str = "train", test_fraction: float = 0.1,
                     cache_dir: str | os.PathLike | None = None, max_files: int | None = None):
    """A ``datasets.Dataset`` with one row per file: columns ``text`` (whole file).

    Args:
        name: a key of ``CORPORA``.
        split: ``"train"``, ``"test"`` (held out by path hash) or ``"all"``.
        test_fraction: share of files in the test split.
        cache_dir: root of hf_kvspec's cache (default ``$HF_KVSPEC_CACHE`` or ``~/.cache/hf_kvspec``).
        max_files: keep only the first ``max_files`` files of the split (sorted by path), for quick runs.
    """
    import datasets

    files = corpus_files(name, split, test_fraction, cache_dir)
    if max_files is not None:
        files = files[:max_files]
    if not files:
        raise CorpusUnavailableError(f"Corpus {name!r} split {split!r} has no files.")
    dataset = datasets.load_dataset("text", data_files=[str(p) for p in files], sample_by="document", split="train",
                                   encoding_errors="replace")
    return dataset.filter(lambda row: bool(row["text"].strip()))
