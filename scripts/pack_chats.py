"""Pack a chats file of ``scripts/make_distill_data.py`` for the repository: drop the rows of some sources, gzip the
rest (byte-reproducible: no timestamp in the header) and write the recipe beside it, counts updated.

Why: ``runs/`` is not committed, so a training run that spans sessions needs its data in the repo; reading-task rows
quote the PSF-licensed Python docs and sources and, as for the committed sample, stay out (``--drop reading:``).

Run:

    python scripts/pack_chats.py runs/drafter_data/distill_chats_cpu.jsonl \
        scripts/train_configs/data/distill_chats_cpu.jsonl.gz --drop reading:

``train_drafter.py --dataset FILE.jsonl.gz`` reads the result (and its ``FILE.jsonl.gz.recipe.json`` for the card).
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from collections import Counter
from pathlib import Path


def pack(source: Path, output: Path, drop: list[str]) -> dict:
    """Write the kept rows to ``output`` (gzip) and the updated recipe beside it; returns the recipe."""
    kept, dropped = [], Counter()
    for line in source.read_text().splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        if row.get("source", "").startswith(tuple(drop)):
            dropped[row["source"]] += 1
        else:
            kept.append(line)
    output.parent.mkdir(parents=True, exist_ok=True)
    with output.open("wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0, filename="") as sink:
        sink.write(("\n".join(kept) + "\n").encode())
    recipe_file = source.with_name(source.name + ".recipe.json")
    recipe = json.loads(recipe_file.read_text()) if recipe_file.is_file() else {}
    rows = recipe.get("rows", {})
    recipe["packed"] = {"from": str(source), "dropped_sources": drop, "rows_dropped": sum(dropped.values()),
                        "rows_kept": len(kept), "original_rows": rows,
                        "command": "python scripts/pack_chats.py " + " ".join(sys.argv[1:])}
    recipe["rows"] = {name: count for name, count in rows.items() if not name.startswith(tuple(drop))}
    output.with_name(output.name + ".recipe.json").write_text(json.dumps(recipe, indent=2) + "\n")
    return recipe


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path, help="a chats JSONL written by make_distill_data.py")
    parser.add_argument("output", type=Path, help="where the .jsonl.gz goes")
    parser.add_argument("--drop", action="append", default=[], help="drop rows whose source starts with this")
    args = parser.parse_args(argv)
    if not args.source.is_file():
        parser.error(f"{args.source}: no such file")
    recipe = pack(args.source, args.output, args.drop)
    print(f"{args.output}: {recipe['packed']['rows_kept']} rows kept, {recipe['packed']['rows_dropped']} dropped, "
          f"{args.output.stat().st_size:,} bytes")


if __name__ == "__main__":
    main()
