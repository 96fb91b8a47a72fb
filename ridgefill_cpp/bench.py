"""Prefill timing, side by side (DESIGN §10): several variants of one prompt, alternated, repeated.

Absolute times on a shared machine are noise; the figure is the ratio of medians measured in one
run, with the same build, threads, context and batch sizes for every variant. Each repetition
visits the variants in a rotated order so that drift (thermal, other load) is spread evenly.

Variants today:

- ``stock``: the model, exact prefill;
- ``first S layers``: the same file cut to its first S layers (:func:`gguf_copy.first_layers_gguf`),
  i.e. prefill as if layers S..L-1 cost nothing. Its speedup is the *physical* ceiling of any
  late-layer skipping on this machine, next to the compute-ratio ceiling L/S.

The library never prints; ``progress(done, total)`` reports evaluations.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Sequence


@dataclass
class BenchResult:
    model: str
    n_layer: int
    split: int
    threads: int | None
    n_batch: int
    repeats: int
    lengths: list[int]
    # variant -> length -> seconds of every repetition
    times: dict[str, dict[int, list[float]]] = field(default_factory=dict)

    def median(self, variant: str, n: int) -> float:
        return statistics.median(self.times[variant][n])

    def speedup(self, variant: str, n: int, base: str = "stock") -> float:
        return self.median(base, n) / self.median(variant, n)

    @property
    def compute_ceiling(self) -> float:
        """1/r for r = S/L: the speedup if late layers cost nothing and early ones everything."""
        return self.n_layer / self.split

    def as_dict(self) -> dict:
        d = asdict(self)
        d["times"] = {v: {str(n): ts for n, ts in by_n.items()} for v, by_n in self.times.items()}
        d["summary"] = [
            {"n_prompt": n, **{f"median_s[{v}]": self.median(v, n) for v in self.times},
             **{f"speedup[{v}]": self.speedup(v, n) for v in self.times if v != "stock"},
             "compute_ceiling": self.compute_ceiling}
            for n in self.lengths
        ]
        return d


def prompt_tokens(llm, n: int) -> list[int]:
    """``n`` prompt tokens of the evaluation split of the default corpus (BOS first when the model uses one)."""
    from .corpus import default_documents
    from .fit import calibration_tokens

    bos = [llm.token_bos()] if llm._model.add_bos_token() and llm.token_bos() >= 0 else []
    body = calibration_tokens(llm, default_documents("evaluation"), n - len(bos))
    if len(body) < n - len(bos):
        raise ValueError(f"the evaluation text has only {len(body)} tokens, {n} were asked for")
    return bos + body


def derived_first_layers(model: os.PathLike | str, split: int) -> Path:
    """The model cut to its first ``split`` layers, cached next to the other derived files."""
    from .gguf_copy import first_layers_gguf
    from .models import cache_dir

    src = Path(model)
    out = cache_dir().parent / "derived" / f"{src.name.removesuffix('.gguf')}.first{split}.gguf"
    if not out.exists() or out.stat().st_mtime < src.stat().st_mtime:
        out.parent.mkdir(parents=True, exist_ok=True)
        first_layers_gguf(src, out, split)
    return out


def benchmark_prefill(
    model: os.PathLike | str,
    *,
    lengths: Sequence[int] = (2048, 4096),
    split: int | None = None,
    repeats: int = 3,
    n_threads: int | None = None,
    n_batch: int = 512,
    progress: Callable[[int, int], None] | None = None,
) -> BenchResult:
    """Median prefill time of each variant for prompts of each length, measured side by side."""
    from .capture import open_model
    from .gguf_model import read_model_info

    info = read_model_info(model)
    split = info.default_split if split is None else int(split)
    if not 1 <= split <= info.n_layer - 1:
        raise ValueError(f"split {split} outside 1..{info.n_layer - 1}")
    lengths = sorted({int(n) for n in lengths})
    if not lengths or lengths[0] < 2:
        raise ValueError("prompt lengths must be at least 2 tokens")
    n_ctx = lengths[-1]
    if info.context_length and n_ctx > info.context_length:
        raise ValueError(f"a {n_ctx}-token prompt is longer than the model's context ({info.context_length})")
    paths = {"stock": Path(model), f"first {split} layers": derived_first_layers(model, split)}
    res = BenchResult(model=str(model), n_layer=info.n_layer, split=split, threads=n_threads, n_batch=n_batch,
                      repeats=repeats, lengths=lengths, times={v: {n: [] for n in lengths} for v in paths})
    llms = {v: open_model(p, n_ctx=n_ctx, n_batch=n_batch, kv_f32=False, n_threads=n_threads) for v, p in paths.items()}
    try:
        prompts = {n: prompt_tokens(llms["stock"], n) for n in lengths}
        for llm in llms.values():  # warm-up: first-call allocations are not prefill
            llm.reset()
            llm.eval(prompts[lengths[0]][: min(64, lengths[0])])
        names = list(llms)
        total, done = repeats * len(lengths) * len(names), 0
        for r in range(repeats):
            for n in lengths:
                order = names[r % len(names):] + names[: r % len(names)]
                for v in order:
                    llm = llms[v]
                    llm.reset()
                    t0 = time.perf_counter()
                    llm.eval(prompts[n])
                    res.times[v][n].append(time.perf_counter() - t0)
                    done += 1
                    if progress:
                        progress(done, total)
    finally:
        for llm in llms.values():
            llm.close()
    return res
