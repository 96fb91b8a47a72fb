"""``ridgefill-gguf --help`` and every command's ``--help``, word for word, against ``cli_help.txt``:
the help a user reads does not change by accident (it was recorded from the single-module CLI before
it became a package of a module per command, and must read the same).

After an intended change of an option or a help text, record it again and review the diff:
``RIDGEFILL_RECORD_HELP=1 pytest tests/test_cli_help.py`` (the test then fails once, saying it wrote
the file)."""

from __future__ import annotations

import os
from pathlib import Path

import typer.main
from typer.testing import CliRunner

RECORD = Path(__file__).with_name("cli_help.txt")
#: a fixed terminal: rich wraps the help to COLUMNS
ENV = {"COLUMNS": "100", "TERM": "dumb", "NO_COLOR": "1"}


def current_help() -> str:
    from ridgefill_cpp.cli import app

    names = list(typer.main.get_command(app).commands)
    runner = CliRunner()
    out = []
    for args in [["--help"]] + [[n, "--help"] for n in names]:
        res = runner.invoke(app, args, env=ENV)
        assert res.exit_code == 0, (args, res.output)
        out.append(f"$ ridgefill-gguf {' '.join(args)}\n{res.output}")
    return "\n".join(out)


def test_every_help_text_reads_as_recorded():
    text = current_help()
    if os.environ.get("RIDGEFILL_RECORD_HELP") == "1":
        RECORD.write_text(text)
        raise AssertionError(f"recorded {RECORD}: review its diff, then run the test again without RIDGEFILL_RECORD_HELP")
    want = RECORD.read_text()
    if text != want:
        import difflib

        diff = "".join(difflib.unified_diff(want.splitlines(True), text.splitlines(True), str(RECORD), "now", n=2))
        raise AssertionError(f"the help differs from {RECORD.name} (RIDGEFILL_RECORD_HELP=1 records it):\n{diff[:6000]}")


def test_the_commands_are_listed_in_their_order():
    from ridgefill_cpp.cli import COMMANDS, app

    names = list(typer.main.get_command(app).commands)
    assert names == [c.replace("_", "-") for c in COMMANDS]
