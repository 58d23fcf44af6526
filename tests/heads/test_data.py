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


def test_packed_chats_load_and_keep_their_recipe(tmp_path):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
    import pack_chats

    rows = [{**chat, "source": source} for chat, source in zip(CHATS, ("self-instruct", "reading:python-docs",
                                                                         "self-instruct follow-up"))]
    source = tmp_path / "chats.jsonl"
    source.write_text("".join(json.dumps(row) + "\n" for row in rows))
    (tmp_path / "chats.jsonl.recipe.json").write_text(json.dumps({"rows": {
        "self-instruct / greedy": 1, "reading:python-docs / greedy": 1, "self-instruct follow-up / greedy": 1}}))
    packed = tmp_path / "data" / "chats.jsonl.gz"
    pack_chats.main([str(source), str(packed), "--drop", "reading:"])
    first = packed.read_bytes()
    pack_chats.main([str(source), str(packed), "--drop", "reading:"])
    assert packed.read_bytes() == first  # no timestamp in the gzip header: the committed bytes are reproducible
    assert load_source(str(packed)).to_list() == [rows[0], rows[2]]
    recipe = json.loads((tmp_path / "data" / "chats.jsonl.gz.recipe.json").read_text())
    assert recipe["rows"] == {"self-instruct / greedy": 1, "self-instruct follow-up / greedy": 1}
    assert recipe["packed"]["rows_dropped"] == 1 and recipe["packed"]["rows_kept"] == 2
