"""Training sources: a gzip-compressed local file loads exactly like the plain one (committed chat files are .gz)."""

from __future__ import annotations

import gzip
import json

import pytest

from hf_kvspec.heads.data import MESSAGES, load_source

CHATS = [{MESSAGES: [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": f"answer {i}"}]}
         for i in range(3)]


@pytest.mark.parametrize("name,text", [
    ("chats.jsonl", "".join(json.dumps(row) + "\n" for row in CHATS)),
    ("notes.txt", "first paragraph\n\nsecond paragraph\n"),
])
def test_gzip_file_loads_like_the_plain_one(tmp_path, name, text):
    (tmp_path / name).write_text(text)
    with gzip.open(tmp_path / f"{name}.gz", "wt") as sink:
        sink.write(text)
    plain, packed = load_source(str(tmp_path / name)), load_source(str(tmp_path / f"{name}.gz"))
    assert packed.column_names == plain.column_names and packed.to_list() == plain.to_list()


def test_missing_gzip_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"chats\.jsonl\.gz: no such file"):
        load_source(str(tmp_path / "chats.jsonl.gz"))
