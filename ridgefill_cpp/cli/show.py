"""Tables several commands print: a model's summary and a map file's per-layer fit quality."""

from __future__ import annotations


from rich.table import Table



def model_table(info) -> Table:
    from ..core.gguf_model import supported_architectures

    t = Table(show_header=False, box=None, pad_edge=False)
    t.add_column(style="bold")
    t.add_column(overflow="fold")
    yes_no = lambda b: "yes" if b else "no"  # noqa: E731
    swa = "none"
    if info.sliding_window:
        swa = f"{len(info.swa_layers)} of {info.n_layer} (window {info.sliding_window}): {layer_ranges(info.swa_layers)}"
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
        rows.append(("recurrent (Gated DeltaNet) layers", f"{len(info.recurrent_layers)}: {layer_ranges(info.recurrent_layers)}"))
    rows += [
        ("context length", str(info.context_length)),
        ("vocabulary", str(info.n_vocab)),
        ("weights", f"{info.file_type or '?'}, {info.n_params / 1e6:.1f}M parameters, {info.file_size / 2**20:.1f} MiB"),
        ("default split S", f"{info.default_split} (L - floor(L/3) = {info.n_layer} - {info.n_layer // 3})"),
        ("RidgeFill support", "yes" if info.supported else f"no (supported: {', '.join(supported_architectures())})"),
    ]
    for k, v in rows:
        t.add_row(k, v)
    return t


def layer_ranges(layers) -> str:
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


def quality_table(meta, title: str) -> Table:
    """Per mapped layer: λ, R² and the held-out relative error, ridge next to identity fill."""
    from ..maps.mapfile import summary_rows

    q = Table(title=title)
    for col in ("layer", "λ", "R²", "ridge rel. err", "identity rel. err"):
        q.add_column(col, justify="right")
    for r in summary_rows(meta):
        q.add_row(str(r["layer"]), f"{r['lambda']:.3g}", f"{r['r2']:.3f}", f"{r['rel_err']:.3f}", f"{r['identity_rel_err']:.3f}")
    return q
