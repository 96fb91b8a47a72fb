"""The ``ridgefill-gguf`` app and what its commands share: the consoles, the error exit, checks of
output paths, the options that several commands parse alike, and the help texts' defaults."""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path
from typing import Iterator, Optional

import typer
from rich.console import Console

from ..core import settings


app = typer.Typer(
    name="ridgefill-gguf",
    help="RidgeFill for llama.cpp GGUF models: inspect models and map files, run the demo.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
out = Console()
err = Console(stderr=True)


def given_options(**options) -> dict:
    """The options given on the command line (not None); the library's defaults apply to the others."""
    return {k: v for k, v in options.items() if v is not None}


def csv(values) -> str:
    """``values`` as a comma-separated list for help texts (``8,16``, ``0,0.05``)."""
    return ",".join(f"{v:g}" if isinstance(v, float) else str(v) for v in values)


def tuned_help(what: str, name: str, first: bool = False) -> str:
    """Help text of an option ``tune`` may set in the map file: the default it resolves to."""
    builtin = settings.TUNABLE_DEFAULTS[name]
    return (f"{what} (default: the {'first ' if first else ''}map file's tuned value, else "
            f"{f'{builtin:g}' if isinstance(builtin, float) else builtin}).")


#: the selector names and the grammar of their token classes, for help texts
SELECTOR_NAMES = f"{', '.join(list(settings.SELECTORS)[:-1])} or {list(settings.SELECTORS)[-1]}"
CLASS_NAMES = "+".join(settings.TOKEN_CLASSES)


#: help of ``--n-gpu-layers`` (fit, bench, eval, tune, demo)
GPU_LAYERS_HELP = ("Layers to offload to a GPU, as llama.cpp's -ngl: a number, or all (default 0: every layer on the "
                   "CPU). A build without a GPU backend (ridgefill-gguf --version lists the backends) runs every layer "
                   "on the CPU and says so.")


def gpu_layers_option():
    """``--n-gpu-layers`` / ``-ngl``, the same on every command that loads a model for computing."""
    return typer.Option(None, "--n-gpu-layers", "-ngl", metavar="N|all", help=GPU_LAYERS_HELP)


#: help of ``--device`` (fit, bench, eval, tune, demo)
DEVICE_HELP = ("Devices to offload to, as llama.cpp's --device: comma-separated names (CUDA0, CUDA0,CUDA1, Vulkan0, ...), "
               "or none for no offload whatever --n-gpu-layers says (default: every GPU this build finds). A name "
               "that is not a device here is refused before the model loads, with the list of those there are.")


def device_option():
    """``--device`` / ``-dev``, the same on every command that loads a model for computing."""
    return typer.Option(None, "--device", "-dev", metavar="NAME[,NAME...]|none", help=DEVICE_HELP)


@contextlib.contextmanager
def using_devices(value: Optional[str]) -> Iterator[None]:
    """While inside, every model the command loads offloads to the devices of ``--device`` (None:
    llama.cpp's default); a name that is not a device ends the command with a clear error first."""
    from ..runtime.devices import device_names, loading_on_devices

    if value is not None:
        try:
            device_names(value)
        except ValueError as e:
            fail(f"--device {value}: {e}")
    with loading_on_devices(value):
        yield


def with_devices(command):
    """A command whose ``device`` parameter is :func:`device_option`: every model it loads offloads to
    those devices (:func:`using_devices` around the whole command)."""
    @functools.wraps(command)
    def run(*args, **kwargs):
        with using_devices(kwargs.get("device")):
            return command(*args, **kwargs)
    return run


def parse_gpu_layers(value: Optional[str]) -> int:
    """``--n-gpu-layers`` as llama-cpp-python's ``n_gpu_layers`` takes it: N >= 0, or -1 for ``all``
    (None: 0). Offloading on a build without a GPU backend is allowed, as in llama.cpp, with a note
    on stderr that the layers stay on the CPU."""
    if value is None:
        return 0
    text = value.strip().lower()
    if text == "all":
        n = -1
    else:
        try:
            n = int(text)
        except ValueError:
            n = -2
        if n < 0:
            fail(f"--n-gpu-layers must be a number of layers (0 or more) or all, not {value!r}")
    if n != 0:
        from ..core.native import build_info

        backends = build_info().get("backends") or []
        if not gpu_backends(backends):
            err.print(f"note: --n-gpu-layers {value}: this build has no GPU backend (backends: {', '.join(backends)}), "
                      "so every layer runs on the CPU", highlight=False, soft_wrap=True)
    return n


def gpu_backends(backends: list[str]) -> list[str]:
    """The backends of a build that offload to a GPU (CUDA, Metal, Vulkan, ...): all but the CPU, BLAS
    and RPC (layers on other machines, given with rpc_servers, not with --n-gpu-layers)."""
    return [b for b in backends if b.upper() not in ("CPU", "BLAS", "RPC")]


def fail(msg: str, code: int = 1) -> None:
    """Print ``error: msg`` on stderr and end the command with exit status ``code`` (no traceback)."""
    err.print(f"[bold red]error:[/] {msg}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def print_timing_warnings(warnings: list[dict], console: Console = out) -> None:
    """The warnings of :func:`ridgefill_cpp.quality.bench.timing_warnings` (a speedup that is noise),
    one a line, below the table that shows the speedups."""
    from rich.text import Text

    for w in warnings:
        console.print(Text.assemble(("warning: ", "bold yellow"), w["message"]))


def check_output_file(path: Path, *, force: bool = True, map_file: bool = False) -> None:
    """An output file, checked before the work starts: a regular file or nothing there (never a
    symlink, FIFO or device), not there unless ``force``, in a writable directory. With ``map_file``
    (a map file is written there) also no GGUF other than a RidgeFill map file: a model is never
    replaced, not even with ``force`` (:func:`ridgefill_cpp.maps.mapfile.check_map_output`)."""
    from ..core.files import check_output

    try:
        if map_file:
            from ..maps.mapfile import check_map_output

            check_map_output(path, overwrite=force)
        else:
            check_output(path, overwrite=force)
    except (ValueError, FileExistsError) as e:  # OutputPathError, MapFileError (a model there)
        fail(str(e))


def check_output_dir(path: Path, option: str) -> None:
    """An output directory (created when the files are written), checked before the work starts."""
    from ..core import files

    try:
        files.check_output_dir(path, option=option)
    except files.OutputPathError as e:
        fail(str(e))


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
    features = [k if v == "1" else f"{k}={v}" for k, v in info.get("cpu_features", {}).items()]
    typer.echo(f"CPU backend compiled with: {' '.join(features) or 'no ISA extensions'}")
    bufts = info.get("cpu_extra_buffer_types", [])
    typer.echo(f"CPU weight buffer types available here: CPU{''.join(', ' + b for b in bufts)}"
               + ("" if "AMX_INT8" not in info.get("cpu_features", {}) or "AMX" in bufts
                  else " (AMX compiled in, but this CPU or kernel does not offer it)"))
    typer.echo(f"libraries: {info['lib_dir']}")
    raise typer.Exit()


@app.callback()
def main(
    ctx: typer.Context,
    version: Optional[bool] = typer.Option(
        None, "--version", callback=_version_callback, is_eager=True,
        help="Show the version, the llama.cpp commit and patch set of the native build, its backends, the CPU paths it was compiled with (ISA extensions, AMX) and the libraries' folder, and exit.",
    ),
    verbose: bool = typer.Option(
        False, "--verbose", "-v",
        help="Show llama.cpp's own log lines (model loading, caches, warnings) on stderr; quiet by default.",
    ),
) -> None:
    """RidgeFill: faster long-prompt prefill for llama.cpp (late-layer KV filled from ridge maps)."""
    import warnings

    from ..core.log import llama_log_override, set_llama_log

    before = llama_log_override()
    set_llama_log(verbose)
    ctx.call_on_close(lambda: set_llama_log(before))  # a command run in-process leaves the switch as it was
    shown = warnings.showwarning
    warnings.showwarning = _show_warning(shown)
    ctx.call_on_close(lambda: setattr(warnings, "showwarning", shown))


def _show_warning(shown):
    """``warnings.showwarning`` for the commands: the package's own warnings (an undigested map file
    loaded) as ``warning: ...`` lines on stderr, whatever --verbose is; any other through ``shown``."""
    from rich.markup import escape

    from ..runtime.native_maps import UndigestedMapsWarning

    def show(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, UndigestedMapsWarning):
            err.print(f"[bold yellow]warning:[/] {escape(str(message))}", highlight=False, soft_wrap=True)
        else:
            shown(message, category, filename, lineno, file, line)

    return show


def read_text_option(text: Optional[list[Path]], what: str) -> Optional[dict[str, list[tuple[str, str]]]]:
    """The documents of --text (eval, tune) as {"text": [(name, text)]}, or None for the default texts;
    ``what`` names the text's use in the messages (``"evaluation text"``, ``"held-out text"``)."""
    from ..fitting.corpus import read_documents

    if not text:
        return None
    try:
        found = read_documents(text, what)
    except (OSError, ValueError) as e:
        fail(str(e))
    if not found:
        fail("--text: no readable text files")
    return {"text": [(d.name, d.text) for d in found]}


def check_prefill_args(model: Path, lengths: Optional[str], selector: str) -> Optional[list[int]]:
    """The --lengths list (None: not given), after checking it, --selector and the model file (bench, eval)."""
    from ..core.gguf_model import GGUFFileError, read_model_info

    try:
        ns = None if lengths is None else [int(x) for x in lengths.split(",") if x.strip()]
    except ValueError:
        fail(f"--lengths must be comma-separated integers, not {lengths!r}")
    try:
        settings.parse_selector(selector)
    except ValueError as e:
        fail(f"--selector: {e}")
    try:
        read_model_info(model)
    except GGUFFileError as e:
        fail(str(e))
    return ns


def resolve_operating_point(maps: Optional[Path], tail: Optional[int], exact_fraction: Optional[float],
                            selector: Optional[str], key_rescale: Optional[int] = None) -> tuple[int, float, str, int]:
    """bench and eval's operating point (:func:`ridgefill_cpp.runtime.prefill.operating_point`); says on stderr
    which values came from the map file."""
    from ..maps.mapfile import MapFileError
    from ..runtime.prefill import operating_point

    try:
        op = operating_point(maps, tail=tail, exact_fraction=exact_fraction, selector=selector, key_rescale=key_rescale)
    except (MapFileError, ValueError) as e:
        fail(str(e))
    if op.from_file:
        err.print(f"the map file's tuned defaults: {', '.join(op.from_file)} (give the option to override)",
                  highlight=False)
    return op.tail, op.exact_fraction, op.selector, op.key_rescale


def number_list(value: str, option: str, kind) -> list:
    """The values of a comma-separated option (``--tails 8,16``) as ``kind``, after checking them."""
    try:
        items = [kind(x) for x in value.split(",") if x.strip()]
    except ValueError:
        fail(f"{option} must be comma-separated {'integers' if kind is int else 'numbers'}, not {value!r}")
    if not items:
        fail(f"{option} is empty: give at least one value")
    return items
