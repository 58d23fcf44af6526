"""Offline real-text corpora: stable, disjoint splits of real files."""

from __future__ import annotations

import pytest

from hf_kvspec.corpus import corpus_files, load_text_corpus


def test_stdlib_splits_are_disjoint_and_stable():
    train = corpus_files("python-stdlib", "train")
    test = corpus_files("python-stdlib", "test")
    assert train and test and not set(train) & set(test)
    assert set(train) | set(test) == set(corpus_files("python-stdlib", "all"))
    assert test == corpus_files("python-stdlib", "test")


def test_load_text_corpus_returns_real_text():
    dataset = load_text_corpus("python-stdlib", "test", max_files=3)
    assert len(dataset) == 3 and all("def " in text or "import" in text for text in dataset["text"])


def test_unknown_corpus_and_split():
    with pytest.raises(ValueError, match="python-docs"):
        corpus_files("wikipedia")
    with pytest.raises(ValueError, match="split"):
        corpus_files("python-stdlib", "validation")
