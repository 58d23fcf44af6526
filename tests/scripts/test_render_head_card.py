"""scripts/render_head_card.py: a committed card is its summary rendered; --check finds a stale one, a run fixes it."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from hf_kvspec.heads.bundled import BUNDLED_HEADS_DIR

SCRIPTS = Path(__file__).resolve().parent.parent.parent / "scripts"


@pytest.fixture(scope="module")
def script():
    sys.path.insert(0, str(SCRIPTS))
    import render_head_card

    return render_head_card


def test_bundled_cards_are_up_to_date(script, capsys):
    folders = sorted(str(p) for p in BUNDLED_HEADS_DIR.iterdir() if (p / "training_summary.json").is_file())
    assert len(folders) >= 3  # medusa, eagle, early_exit at least
    assert script.main(["--check", *folders]) == 0, capsys.readouterr().out


def test_check_finds_a_stale_card_and_a_run_renders_it_again(script, tmp_path, capsys):
    folder = tmp_path / "head"
    shutil.copytree(BUNDLED_HEADS_DIR / "smollm2-135m-instruct-medusa", folder)
    fresh = (folder / "README.md").read_text()
    (folder / "README.md").write_text(fresh.replace("Chain τ", "Chain tau"))
    assert script.main(["--check", str(folder)]) == 1
    assert "out of date" in capsys.readouterr().out and "Chain tau" in (folder / "README.md").read_text()
    assert script.main([str(folder)]) == 0 and (folder / "README.md").read_text() == fresh
    assert script.main(["--check", str(folder)]) == 0


def test_a_folder_without_a_summary_is_refused_naming_what_to_pass(script, tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="not a checkpoint's head/ folder"):
        script.render(tmp_path)
