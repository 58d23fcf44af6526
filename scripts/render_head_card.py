"""Render a saved head's model card (``README.md``) again from its ``training_summary.json`` and ``config.json``.

Why: a card is its summary rendered (``hf_kvspec.hub``; ``scripts/train_drafter.py`` writes both at the end of a
run). When the template (``model_cards/``) or the renderer changes, the committed cards are rendered again with this
script instead of retraining; the bundled-head tests compare each committed card with a fresh rendering.

Run:

    python scripts/render_head_card.py hf_kvspec/bundled_heads/*/            # rewrite README.md in each folder
    python scripts/render_head_card.py --check hf_kvspec/bundled_heads/*/    # exit 1 if one is out of date

A summary's optional ``"card"`` entry holds ``CardFields`` overrides (the exit adapter's decoding-loop figures).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def render(folder: Path) -> str:
    """The card ``folder``'s summary and config render to."""
    from hf_kvspec import hub
    from hf_kvspec.heads.registration import HEAD_CLASSES

    summary_file, config_file = folder / "training_summary.json", folder / "config.json"
    for required in (summary_file, config_file):
        if not required.is_file():
            raise FileNotFoundError(f"{required} is missing: pass a folder scripts/train_drafter.py wrote (a run's "
                                    "--output_dir or a bundled head), not a checkpoint's head/ folder.")
    summary = json.loads(summary_file.read_text())
    model_type = json.loads(config_file.read_text()).get("model_type")
    config_class = {config.model_type: config for config, _ in HEAD_CLASSES}.get(model_type)
    if config_class is None:
        raise ValueError(f"{config_file} has model_type {model_type!r}, not a head hf_kvspec renders cards for.")
    config = config_class.from_pretrained(folder)
    return hub.render_model_card(config, hub.CardFields.from_summary(summary, **summary.get("card", {})))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", nargs="+", type=Path, help="head folders holding training_summary.json")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a card is out of date")
    args = parser.parse_args(argv)
    stale = []
    for folder in args.folders:
        card, path = render(folder), folder / "README.md"
        if path.is_file() and path.read_text() == card:
            continue
        stale.append(path)
        if not args.check:
            path.write_text(card)
    verb = "out of date" if args.check else "rendered again"
    for path in stale:
        print(f"{verb}: {path}")
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
