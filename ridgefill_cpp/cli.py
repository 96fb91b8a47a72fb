"""``ridgefill-gguf``: the command line of ridgefill-cpp (typer app; formatting lives here only)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

app = typer.Typer(
    name="ridgefill-gguf",
    help="RidgeFill for llama.cpp GGUF models: inspect models and map files, run the demo.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
out = Console()
err = Console(stderr=True)


def _fail(msg: str, code: int = 1) -> None:
    err.print(f"[bold red]error:[/] {msg}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def _version_callback(value: bool) -> None:
    if not value:
        return
    import ridgefill_cpp

    info = ridgefill_cpp.build_info()
    typer.echo(f"ridgefill-gguf {ridgefill_cpp.__version__}")
    typer.echo(
        f"llama.cpp {info['llama_cpp_commit']} (llama-cpp-python {info['llama_cpp_python']} sdist), "
        f"patch set {info['patchset']}, {info['build_type']} build, {info['compiler']}"
    )
    typer.echo(f"backends: {', '.join(info['backends'])}")
    typer.echo(f"libraries: {info['lib_dir']}")
    raise typer.Exit()


@app.callback()
def main(
    version: Optional[bool] = typer.Option(
        None, "--version", callback=_version_callback, is_eager=True,
        help="Show the version, the llama.cpp commit and patch set of the native build, and exit.",
    ),
) -> None:
    """RidgeFill: faster long-prompt prefill for llama.cpp (late-layer KV filled from ridge maps)."""


def _model_table(info) -> Table:
    t = Table(show_header=False, box=None, pad_edge=False)
    t.add_column(style="bold")
    t.add_column(overflow="fold")
    yes_no = lambda b: "yes" if b else "no"  # noqa: E731
    swa = "none"
    if info.sliding_window:
        swa = f"{len(info.swa_layers)} of {info.n_layer} (window {info.sliding_window}): {_ranges(info.swa_layers)}"
    rows = [
        ("file", info.path),
        ("name", info.name or "-"),
        ("architecture", info.architecture),
        ("layers", str(info.n_layer)),
        ("n_embd", str(info.n_embd)),
        ("heads", str(info.n_head)),
        ("KV heads", str(info.n_head_kv)),
        ("head dim", str(info.head_dim)),
        ("QK-norm", yes_no(info.qk_norm)),
        ("sliding-window layers", swa),
    ]
    if info.recurrent_layers:
        rows.append(("recurrent (Gated DeltaNet) layers", f"{len(info.recurrent_layers)}: {_ranges(info.recurrent_layers)}"))
    rows += [
        ("context length", str(info.context_length)),
        ("vocabulary", str(info.n_vocab)),
        ("weights", f"{info.file_type or '?'}, {info.n_params / 1e6:.1f}M parameters, {info.file_size / 2**20:.1f} MiB"),
        ("default split S", f"{info.default_split} (L - floor(L/3) = {info.n_layer} - {info.n_layer // 3})"),
        ("RidgeFill support", "yes" if info.supported else "no (supported: llama, qwen3, gemma3, qwen35)"),
    ]
    for k, v in rows:
        t.add_row(k, v)
    return t


def _ranges(layers) -> str:
    layers = list(layers)
    if not layers:
        return "-"
    parts, start, prev = [], layers[0], layers[0]
    for x in layers[1:] + [None]:
        if x is not None and x == prev + 1:
            prev = x
            continue
        parts.append(f"{start}" if start == prev else f"{start}-{prev}")
        if x is not None:
            start = prev = x
    return ",".join(parts)


@app.command()
def info(
    file: Path = typer.Argument(..., help="A model GGUF file."),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON instead of a table."),
) -> None:
    """Show what RidgeFill needs to know about a model GGUF: layers, heads, QK-norm, sliding-window
    layers, context length, the default split S, and whether RidgeFill supports its architecture."""
    from .gguf_model import GGUFFileError, read_model_info

    try:
        mi = read_model_info(file)
    except GGUFFileError as e:
        _fail(str(e))
    if as_json:
        print(json.dumps(mi.as_dict(), indent=2))
    else:
        out.print(_model_table(mi))


@app.command()
def demo(
    model: Optional[Path] = typer.Option(None, help="Model GGUF (default: SmolLM2-135M-Instruct Q4_1 from PyPI)."),
    prompt: str = typer.Option(
        "The three primary colours are", help="Prompt for the short generation run."
    ),
    max_tokens: int = typer.Option(24, min=1, help="Tokens to generate."),
    threads: Optional[int] = typer.Option(None, min=1, help="CPU threads (default: llama.cpp's choice)."),
) -> None:
    """Run the main job on the default model: show the native build and the model summary, load the
    model through the patched llama.cpp and generate from a short prompt."""
    import ridgefill_cpp
    from . import models
    from .gguf_model import read_model_info

    if model is None:
        with err.status("locating the default model (installing it from the package registry if needed)"):
            model = models.path(models.DEFAULT_MODEL)
    bi = ridgefill_cpp.build_info()
    out.rule("native build")
    out.print(f"llama.cpp {bi['llama_cpp_commit']}, patch set {bi['patchset']}, backends {', '.join(bi['backends'])}")
    out.rule("model")
    out.print(_model_table(read_model_info(model)))
    out.rule("generation (stock prefill through the patched library)")
    t0 = time.perf_counter()
    llm = ridgefill_cpp.Llama(str(model), n_ctx=2048, n_threads=threads, verbose=False, flash_attn=True)
    t_load = time.perf_counter() - t0
    try:
        n_prompt = len(llm.tokenize(prompt.encode()))
        t0 = time.perf_counter()
        res = llm(prompt, max_tokens=max_tokens, temperature=0.0)
        t_gen = time.perf_counter() - t0
        text = res["choices"][0]["text"]
        n_gen = res["usage"]["completion_tokens"]
        out.print(f"[bold]{prompt}[/]{text}", highlight=False)
        out.print(
            f"load {t_load:.2f} s; {n_prompt} prompt tokens + {n_gen} generated in {t_gen:.2f} s",
            highlight=False,
        )
    finally:
        llm.close()
