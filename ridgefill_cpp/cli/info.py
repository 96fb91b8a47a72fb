"""``ridgefill-gguf info``: what RidgeFill needs to know about a model GGUF, or what a map file holds."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from ..core import settings
from .app import (app, err, fail,
                  out)
from .show import model_table, quality_table


@app.command()
def info(
    file: Path = typer.Argument(..., help="A model GGUF, or a RidgeFill map file (*.ridgefill.gguf)."),
    model: Optional[Path] = typer.Option(
        None, "--model", "-m", help="For a map file: check whether the maps fit this model GGUF, and say why not."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON instead of a table."),
) -> None:
    """Show what RidgeFill needs to know about a model GGUF (layers, heads, QK-norm, sliding-window
    layers, context length, default split S, support), or what a map file holds (split, objective,
    calibration, per-layer λ and held-out fit quality next to identity fill)."""
    from ..core.gguf_model import GGUFFileError, read_metadata, read_model_info
    from ..maps.mapfile import MapFileError, compatibility_problems, read_map_file

    try:
        md = read_metadata(file)
    except GGUFFileError as e:
        fail(str(e))
    if md.get("general.type") == "adapter":
        try:
            maps = read_map_file(file)
        except MapFileError as e:
            fail(str(e))
        problems = None
        if model is not None:
            try:
                problems = compatibility_problems(maps.meta, model, maps.g)
            except GGUFFileError as e:
                fail(str(e))
        _show_map_file(file, maps.meta, problems, model, as_json, gains=maps.g, gain_settings=maps.state_gain_settings)
        if problems:
            raise typer.Exit(1)
        return
    if model is not None:
        fail(f"{file} is a model, not a map file: --model applies to map files")
    try:
        mi = read_model_info(file)
    except GGUFFileError as e:
        fail(str(e))
    if as_json:
        print(json.dumps(mi.as_dict(), indent=2))
    else:
        out.print(model_table(mi))


def _state_gain_settings_text(s: dict) -> str:
    """The operating point the state gains were fitted at, in words ('' when the file does not say)."""
    if not s:
        return ""
    parts = []
    if "tail" in s:
        parts.append(f"T = {s['tail']}")
    if "exact_fraction" in s:
        parts.append(f"exact fraction {s['exact_fraction']:g}")
    if "selector" in s:
        parts.append(f"selector {s['selector']}")
    if "value_rescale" in s:
        parts.append(f"value rescale {s['value_rescale']}")
    if "windows" in s or "window_rows" in s:
        parts.append(f"{s.get('windows', '?')} windows of {s.get('window_rows', '?')} rows")
    return "fitted at " + ", ".join(parts)


def _show_map_file(path, meta, problems, model, as_json: bool, gains=None, gain_settings=None) -> None:
    from dataclasses import asdict

    from ..core.gguf_model import HYBRID_ARCHITECTURES
    from ..maps.compact import map_bytes
    from ..maps.mapfile import describe_form, map_tensor_bytes_by_layer, read_tuned_defaults
    from ..runtime.native_maps import undigested_allowed

    per_layer = map_tensor_bytes_by_layer(path)
    n_bytes = sum(per_layer.values())
    f16_bytes = map_bytes(meta.n_embd, len(meta.layers), "f16") + sum(
        g.size * 4 for g in (gains or {}).values())  # the same maps as full F16 matrices
    tuned = read_tuned_defaults(path)
    if as_json:
        d = asdict(meta)
        d["input_norm"] = meta.input_norm
        d["maps_bytes"] = n_bytes
        d["maps_bytes_per_layer"] = {str(il): n for il, n in per_layer.items()}
        d["maps_bytes_full_f16"] = f16_bytes
        d["tuned"] = tuned
        d["has_state_gains"] = bool(gains)
        d["state_gains"] = {str(il): [float(x) for x in g] for il, g in sorted(gains.items())} if gains else None
        d["state_gain_settings"] = dict(gain_settings or {}) if gains else None
        if problems is not None:
            d["fits_model"] = {"model": str(model), "ok": not problems, "problems": problems}
        print(json.dumps(d, indent=2))
        return
    t = Table(show_header=False, box=None, pad_edge=False)
    t.add_column(style="bold")
    t.add_column(overflow="fold")
    for k, v in [
        ("file", str(path)),
        ("maps for", f"{meta.model_name} ({meta.architecture}, {meta.n_layer} layers, n_embd {meta.n_embd})"),
        ("model fingerprint", meta.fingerprint),
        ("split S", f"{meta.split_layer}: maps for layers {meta.layers[0]}-{meta.layers[-1]}"),
        ("objective", f"{meta.objective} (input φ = {meta.input_norm})"),
        ("calibration", f"{meta.calib_n_tokens} tokens in windows of {meta.calib_windows} ({meta.calib_n_rows} rows used, "
                        f"first {meta.calib_skip_rows} of each window skipped); {meta.calib_source}"),
        ("held-out rows", str(meta.heldout_n_rows)),
        ("maps", describe_form(meta)),
        ("memory", f"{n_bytes / 2**20:.2f} MiB of maps ({n_bytes:,} bytes; "
                   + (f"{min(per_layer.values()):,}" if len(set(per_layer.values())) == 1 else
                      f"{min(per_layer.values()):,} to {max(per_layer.values()):,}")
                   + f" per layer; {n_bytes / f16_bytes:.2f}x of full F16 maps): with their layers' weights by default "
                   "(resident: VRAM on a GPU build), or in pinned host memory, streamed to the GPU once per layer, with "
                   "RidgeFill(placement=\"host\"); the same bytes either way"),
        ("written by", f"ridgefill-cpp {meta.tool_version}, format {meta.format_version}"),
        ("content digest", "XXH64 of every tensor, checked: the weights are as written" if meta.digest else
                           "none (written before map files had one): corrupted weights cannot be detected, "
                           + ("and libllama loads the file only because LLAMA_RIDGEFILL_ALLOW_UNDIGESTED is set"
                              if undigested_allowed() else "so libllama refuses the file")
                           + "; `ridgefill-gguf digest FILE` adds one"),
    ]:
        t.add_row(k, v)
    if gains:
        t.add_row("state gains", "; ".join(f"layer {il}: {g.size} heads, {float(g.min()):.3f} / {float(g.mean()):.3f} / "
                                           f"{float(g.max()):.3f} (min / mean / max)" for il, g in sorted(gains.items()))
                  + f"; {_state_gain_settings_text(gain_settings or {}) or 'operating point not recorded'}"
                  + " - for RidgeFill(state_correction=\"gain\")")
    elif meta.architecture in HYBRID_ARCHITECTURES:
        t.add_row("state gains", "none (ridgefill-gguf fit --state-gains writes them)")
    if tuned:
        measured = ", ".join(f"{label} {tuned[key]:{fmt}}" for key, label, fmt in
                             (("delta_nll_novel", "novel ΔNLL", "+.4f"), ("speedup", "speed", ".2f"),
                              ("budget", "budget", "g")) if key in tuned)
        span = f" (span {tuned['span']})" if "span" in tuned and tuned["selector"] in settings.SPAN_SELECTORS else ""
        key = f", key rescale c_K = {tuned['key_rescale']}" if tuned.get("key_rescale") else ""
        checked = (f"; retrieval kept {tuned['retrieval_kept']}/{tuned['retrieval_exact']} of exact's on "
                   f"{tuned['retrieval_prompts']} prompts" if "retrieval_prompts" in tuned else "")
        t.add_row("tuned defaults", f"T = {tuned['tail']}, exact fraction {tuned['exact_fraction']:g}, selector "
                                    f"{tuned['selector']}{span}{key} (ridgefill-gguf tune: {measured}{checked})")
    out.print(t)
    out.print(quality_table(meta, "held-out fit quality (relative error of the direction the layer sees)"))
    if problems is not None:
        if problems:
            err.print(f"[bold red]the maps do not fit {model}:[/]", highlight=False, soft_wrap=True)
            for p in problems:
                err.print(f"  - {p}", highlight=False, soft_wrap=True)
        else:
            out.print(f"[green]the maps fit {model}[/] (architecture, dimensions and fingerprint match)", highlight=False)
