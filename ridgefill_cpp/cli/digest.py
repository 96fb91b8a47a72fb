"""``ridgefill-gguf digest``: a content digest for a map file written before they existed."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from .app import (app, check_output_file, fail,
                  out)


@app.command("digest")
def digest_cmd(
    maps: Path = typer.Argument(..., help="A RidgeFill map file (*.ridgefill.gguf)."),
    output: Optional[Path] = typer.Option(
        None, "--output", "-o", help="Write the file with its digest here instead of replacing MAPS (atomically either way)."),
    force: bool = typer.Option(
        False, "--force", "-f",
        help="Replace an existing --output file; a GGUF that is not a RidgeFill map file (a model) is never replaced."),
) -> None:
    """Give a map file written before map files carried a content digest (ridgefill.digest.xxh64) one:
    the XXH64 of every tensor as its bytes are now, so that any later change to them is refused at load.
    Without one, libllama, Llama and llama-server refuse the file (unless
    LLAMA_RIDGEFILL_ALLOW_UNDIGESTED=1). Only for a file whose bytes you trust: a digest vouches for
    what is there. A file that has a digest is checked against it and left as it is. A file that cannot
    be a finished map file is refused: values the loader refuses (NaN, Inf), a map matrix that is all
    zeros, or a file that changes while it is read (still being written)."""
    from ..maps.mapfile import MapFileError, add_digest

    if output is not None and output.resolve() != maps.resolve():
        check_output_file(output, force=force, map_file=True)
    else:
        check_output_file(maps.resolve())
    try:
        path, written = add_digest(maps, output, overwrite=force)
    except (MapFileError, OSError) as e:
        fail(str(e))
    if written:
        out.print(f"wrote {path}: a content digest (XXH64) of each of its tensors", highlight=False)
    else:
        out.print(f"{path} already has a content digest: checked, every tensor is as written; nothing to do",
                  highlight=False)
