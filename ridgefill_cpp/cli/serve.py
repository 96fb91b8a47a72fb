"""``ridgefill-gguf serve``: the patched llama-server."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from ..core import settings
from .app import (SELECTOR_NAMES, app, fail,
                  given_options, out, tuned_help)


@app.command("serve")
def serve_cmd(
    model: Path = typer.Argument(..., help="The model GGUF to serve (never modified)."),
    server_args: Optional[list[str]] = typer.Argument(
        None, metavar="-- LLAMA-SERVER ARGS",
        help="Any other llama-server argument, after --, passed unchanged (e.g. -- -np 4 -c 8192); an --api-key "
             "among them reaches llama-server through its environment, not its command line."),
    maps: Optional[Path] = typer.Option(
        None, "--maps", "-m", help="Map file of `fit`: RidgeFill with ridge maps (the file's split; the tuned "
                                   "tail, fraction and selector of `tune` unless given). Checked against the model first."),
    identity_split: Optional[int] = typer.Option(
        None, "--identity-split", min=1, help="RidgeFill with identity fill at this split S, without maps."),
    tail: Optional[int] = typer.Option(
        None, "--tail", min=1, help=tuned_help("T: the last prompt rows, always exact", "tail")),
    exact_fraction: Optional[float] = typer.Option(
        None, "--exact-fraction", min=0.0, max=1.0,
        help=tuned_help("Share of the prefix rows the selector keeps exact", "exact_fraction")),
    selector: Optional[str] = typer.Option(
        None, "--selector", help=tuned_help(f"Exact-row selector: {SELECTOR_NAMES}, optionally @SPAN: the attention and probe "
                                            "selectors keep the SPAN rows around each top-scoring row exact together "
                                            "(e.g. attention@16)", "selector")),
    min_prompt: Optional[int] = typer.Option(
        None, "--min-prompt", min=0,
        help=f"Prompts with fewer new tokens run stock prefill (default {settings.MIN_PROMPT})."),
    key_rescale: Optional[int] = typer.Option(
        None, "--key-rescale", min=0,
        help=tuned_help("c_K: tail rows a per-head scale of the filled keys is measured on (0: off)", "key_rescale")),
    host: str = typer.Option("127.0.0.1", "--host", help="The one address to listen on (default: loopback only)."),
    port: int = typer.Option(8080, "--port", min=0, max=65535, help="Port to listen on (0: a free one)."),
    api_key: Optional[str] = typer.Option(
        None, "--api-key", help="Require this key (Authorization: Bearer KEY) on the API endpoints. llama-server "
                                "gets it (and any --api-key after --) through its environment (LLAMA_API_KEY), never "
                                "on its command line; this command's own command line still shows it to every user "
                                "of the machine: prefer --api-key-file or LLAMA_API_KEY=KEY in the environment."),
    api_key_file: Optional[Path] = typer.Option(
        None, "--api-key-file", help="Require the keys in this file (one per line; lines starting with # are "
                                     "comments), read by llama-server (--api-key-file)."),
    startup_timeout: float = typer.Option(
        600.0, "--startup-timeout", min=1.0, help="Seconds to wait for the model to load and /health to answer."),
) -> None:
    """Serve a model over HTTP with RidgeFill: runs the project's patched llama.cpp llama-server binary
    (installed with the package; not a Python re-implementation), with its OpenAI-compatible API
    (/v1/completions, /v1/chat/completions) and its own /completion, /health, /metrics. RidgeFill
    settings (--maps or --identity-split, --tail, --exact-fraction, --selector, --key-rescale, --min-prompt)
    become the server's defaults; without --maps and --identity-split it is stock llama-server.
    Each request may carry a "ridgefill" JSON field: false (exact prefill for this request), true
    (the server's settings) or an object {"tail", "exact_fraction", "selector", "span"} overriding them.
    It binds 127.0.0.1 unless --host says otherwise. Arguments after -- go to llama-server
    unchanged. Prints the URL once the server is healthy; Ctrl-C or SIGTERM stops it cleanly."""
    from ..server.serve import ServerError, serve
    from ..runtime.prefill import RidgeFill

    if maps is not None and identity_split is not None:
        fail("give --maps or --identity-split, not both")
    try:
        given = given_options(tail=tail, exact_fraction=exact_fraction, min_prompt=min_prompt, key_rescale=key_rescale,
                              **(settings.parse_selector(selector) if selector is not None else {}))
        if maps is not None:
            rf = RidgeFill(maps, **given)
        elif identity_split is not None:
            rf = RidgeFill.identity(identity_split, **given)
        else:
            if given:
                fail(f"{', '.join('--' + k.replace('_', '-') for k in given)}: RidgeFill settings need --maps "
                     "or --identity-split")
            rf = None
        extra = list(server_args or [])
        if api_key_file is not None:
            extra += ["--api-key-file", str(api_key_file)]
        rc = serve(model, rf, host=host, port=port, api_key=api_key, extra_args=extra,
                   startup_timeout=startup_timeout, echo=lambda s: out.print(s, markup=False, highlight=False, soft_wrap=True))
    except (ValueError, ServerError) as e:
        fail(str(e))
    raise typer.Exit(rc)
