"""``ridgefill-gguf --help`` and every command's ``--help`` say what they said: each command's help
text and, for each option and argument, its names, help, default, type and whether it is required,
against ``cli_help.json`` (recorded from the single-module CLI before it became a package of a module
per command). Compared as data, not as rendered text, so that a new typer or rich release that draws
the boxes differently does not fail it.

After an intended change of an option or a help text, record it again and review the diff:
``RIDGEFILL_RECORD_HELP=1 pytest tests/test_cli_help.py`` (the test then fails once, saying it wrote
the file)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import typer.main
from typer.testing import CliRunner

RECORD = Path(__file__).with_name("cli_help.json")


def _param(p) -> dict:
    """One option or argument as data (typer's own click parameter; attributes read with getattr so
    that typer versions that name their internals differently still compare)."""
    default = getattr(p, "default", None)
    if callable(default) or not isinstance(default, (str, int, float, bool, list, type(None))):
        default = repr(default)
    out = {"name": p.name, "kind": type(p).__name__}
    for key in ("opts", "secondary_opts", "help", "required", "is_flag", "hidden", "min", "max", "multiple", "nargs"):
        value = getattr(p, key, None)
        out[key] = list(value) if isinstance(value, (list, tuple)) else value
    out["default"] = default
    return out


def current_help() -> dict:
    from ridgefill_cpp.cli import app

    group = typer.main.get_command(app)
    out = {"": {"help": group.help, "params": [_param(p) for p in group.params]}}
    for name, cmd in group.commands.items():
        out[name] = {"help": cmd.help, "params": [_param(p) for p in cmd.params]}
    return out


def test_every_help_text_says_what_it_said():
    now = current_help()
    if os.environ.get("RIDGEFILL_RECORD_HELP") == "1":
        RECORD.write_text(json.dumps(now, indent=1, ensure_ascii=False) + "\n")
        raise AssertionError(f"recorded {RECORD}: review its diff, then run the test again without RIDGEFILL_RECORD_HELP")
    want = json.loads(RECORD.read_text())
    assert list(now) == list(want), "the commands differ (or their order)"
    for name in want:
        assert now[name]["help"] == want[name]["help"], f"{name or 'the app'}: its help text differs"
        assert [p["name"] for p in now[name]["params"]] == [p["name"] for p in want[name]["params"]], name
        for p, q in zip(now[name]["params"], want[name]["params"]):
            assert p == q, (name, p["name"])


def test_every_help_renders():
    """Each ``--help`` prints (typer's rendering of the data above) and exits 0."""
    from ridgefill_cpp.cli import app

    runner = CliRunner()
    for args in [["--help"]] + [[n, "--help"] for n in current_help() if n]:
        res = runner.invoke(app, args, env={"COLUMNS": "100", "NO_COLOR": "1"})
        assert res.exit_code == 0 and "Usage: ridgefill-gguf" in res.output, (args, res.output)


def test_the_commands_are_listed_in_their_order():
    from ridgefill_cpp.cli import COMMANDS, app

    assert list(typer.main.get_command(app).commands) == [c.replace("_", "-") for c in COMMANDS]
