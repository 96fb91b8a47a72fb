"""Where a planned prefill's time goes: one prompt of N tokens prefilled in the library by stock and by
RidgeFill settings, twice each (the faster counts), with libllama's own split of the RidgeFill time into
the early phase (layers 0..S-1 of every row) and the late phase (the late layers of the exact rows, and
the fill of the others: map, norm and K/V projection per filled row and late layer). Flash attention
and 512-row batches as `bench` uses them (issue #47: why speedup / ceiling drops at low S).

    python tools/measure/late_breakdown.py MODEL N stock MAPS:FRACTION [MAPS:FRACTION ...]
"""

from __future__ import annotations

import sys
import time

import ridgefill_cpp  # noqa: F401  (the patched libraries)
from ridgefill_cpp import Llama, RidgeFill
from ridgefill_cpp.quality.bench import prompt_tokens


def main(argv: list[str]) -> int:
    model, n, runs = argv[0], int(argv[1]), argv[2:]
    for spec in runs:
        rf = None
        if spec != "stock":
            maps, frac = spec.rsplit(":", 1)
            rf = RidgeFill(maps, tail=64, exact_fraction=float(frac), selector="attention", span=16)
        llm = Llama(model, n_ctx=n + 64, n_batch=512, n_ubatch=512, n_threads=2, n_threads_batch=2,
                    flash_attn=True, verbose=False, ridgefill=rf)
        toks = prompt_tokens(llm, n)
        times = []
        for _ in range(2):
            llm.reset()
            t0 = time.perf_counter()
            llm.prefill(toks, n_logits=1)
            times.append(time.perf_counter() - t0)
        st = llm.ridgefill_stats
        tm = st.get("times_ms", {})
        print(f"{spec}: {min(times) * 1000:.0f} ms", {k: st.get(k) for k in ("split", "n_filled", "n_exact", "ceiling")},
              {k: round(tm[k]) for k in ("early", "late") if k in tm})
        llm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
