"""Derived model copies (first S layers, F32) and the side-by-side prefill benchmark."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

from ridgefill_cpp.quality.bench import benchmark_prefill
from ridgefill_cpp.fitting.capture import capture_layer_inputs
from ridgefill_cpp.maps.gguf_copy import first_layers_gguf
from ridgefill_cpp.core.gguf_model import read_model_info


@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen35"])
def test_first_layers_copy_computes_the_same_early_layers(tiny_models, tmp_path, arch):
    src = tiny_models[arch]
    digest = hashlib.sha256(src.read_bytes()).hexdigest()
    full = read_model_info(src)
    n = full.n_layer - 2
    cut = first_layers_gguf(src, tmp_path / "cut.gguf", n)
    info = read_model_info(cut)
    assert info.n_layer == n and info.n_embd == full.n_embd
    assert info.swa_layers == tuple(il for il in full.swa_layers if il < n)
    assert info.recurrent_layers == tuple(il for il in full.recurrent_layers if il < n)
    tokens = list(range(1, 80))
    a = capture_layer_inputs(src, tokens, layers=list(range(n)), flash_attn=False)
    b = capture_layer_inputs(cut, tokens, layers=list(range(n)), flash_attn=False)
    assert np.array_equal(a.layer_inputs, b.layer_inputs)  # same kernels, same numbers
    assert hashlib.sha256(src.read_bytes()).hexdigest() == digest  # the source is only read


def test_first_layers_range(tiny_models, tmp_path):
    with pytest.raises(ValueError, match="outside 1..6"):
        first_layers_gguf(tiny_models["llama"], tmp_path / "x.gguf", 7)
    assert not (tmp_path / "x.gguf").exists()


def test_benchmark_runs_side_by_side(tiny_models, cli, tmp_path, monkeypatch):
    from ridgefill_cpp.cli.app import out as console

    monkeypatch.setattr(console, "width", 250)  # the table's headers whole (80 columns cut them: "ceili…")
    res = benchmark_prefill(tiny_models["llama"], lengths=[96, 32], split=3, tail=8, min_prompt=64, first_layers=True,
                            repeats=2, n_threads=1, greedy_tokens=4)
    assert res.lengths == [32, 96] and res.compute_ceiling == 2.0
    assert set(res.times) == {"stock", "identity", "first 3 layers"}
    for v in res.times:
        for n in res.lengths:
            assert len(res.times[v][n]) == 2 and all(t > 0 for t in res.times[v][n])
    # 32 < min_prompt: stock prefill in every variant, same logits; 96: a plan, its ceiling from the plan
    assert res.kl["identity"][32] == 0.0 and res.greedy_agree["identity"][32] == 4
    assert res.ceiling[32] == 1.0
    r = 3 / 6 + (1 - 3 / 6) * (8 + 9) / 96  # S/L + (1 - S/L)(T + |E|)/N, |E| = ceil(0.1 * 88)
    assert res.ceiling[96] == pytest.approx(1 / r, rel=1e-6)
    assert res.kl["identity"][96] > 0
    # the figures beside the speedup (their values are this machine's noise: only their definitions are checked)
    assert res.tokens_per_s(96) == pytest.approx(96 / res.median("stock", 96))
    assert res.spread("identity", 96) == pytest.approx(max(res.times["identity"][96]) / min(res.times["identity"][96]) - 1)
    assert res.ceiling_of("stock", 96) is None and res.ceiling_of("identity", 96) == res.ceiling[96]
    assert res.ceiling_of("first 3 layers", 96) == 2.0  # no plan: the compute ceiling L/S

    out = tmp_path / "bench.json"
    r = cli("bench", tiny_models["llama"], "--lengths", "40,80", "--repeats", 1, "--threads", 1, "--json", out,
            "--min-prompt", 50, "--tail", 8, "--first-layers")
    assert r.exit_code == 0, r.output
    d = json.loads(out.read_text())
    assert [row["n_prompt"] for row in d["summary"]] == [40, 80]
    assert set(d["times"]) == {"stock", "identity", "first 4 layers"}
    assert d["summary"][0]["ceiling"] == 1.0 and d["summary"][1]["ceiling"] > 1.0
    assert "ceiling" in r.output and "quality against stock" in r.output and "min-prompt" in r.output
    assert all(row["tokens_per_s[stock]"] > 0 and row["spread[stock]"] is None for row in d["summary"])
    assert isinstance(d["timing_warnings"], list) and len(d["timing_notes"]) == 1
    assert "a single repeat cannot show noise" in " ".join(r.output.split())


def test_benchmark_with_maps(tiny_models, cli, tmp_path):
    from ridgefill_cpp.fitting import corpus
    from ridgefill_cpp.fitting.fit import FitOptions, fit_ridge_maps
    from ridgefill_cpp.maps.mapfile import write_map_file

    fit = fit_ridge_maps(tiny_models["llama"], corpus.default_documents("calibration"),
                         FitOptions(n_tokens=2000, ctx=128, split=4, n_threads=1))
    maps = write_map_file(tmp_path / "m.gguf", fit.maps)
    res = benchmark_prefill(tiny_models["llama"], maps=maps, lengths=[120], tail=8, min_prompt=0, repeats=1,
                            n_threads=1, greedy_tokens=3, identity=False)
    assert set(res.times) == {"stock", "ridgefill"} and res.split == 4
    assert 0 < res.kl["ridgefill"][120] < 1
    with pytest.raises(ValueError, match="fitted for split 4"):
        benchmark_prefill(tiny_models["llama"], maps=maps, split=3, lengths=[64])
    r = cli("bench", tiny_models["llama"], "--lengths", "64", "--no-identity")
    assert r.exit_code == 1 and "nothing to compare with stock" in r.output

    # the GPU placement measurement script (tools/measure/gpu_h200_placement.py) runs end to end on a CPU
    # build too: three processes, where the maps live, no VRAM figure without nvidia-smi
    import subprocess
    import sys
    from pathlib import Path

    tools = Path(__file__).resolve().parents[1] / "tools" / "measure"
    out = tmp_path / "placement.json"
    run = subprocess.run([sys.executable, str(tools / "gpu_h200_placement.py"), "--model", str(tiny_models["llama"]),
                          "--maps", str(maps), "--lengths", "100", "--repeats", "1", "--tail", "8", "--n-batch", "64",
                          "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    d = json.loads(out.read_text())
    assert set(d) == {"stock", "resident", "host"} and d["stock"]["maps"] is None
    for v in ("resident", "host"):
        assert d[v]["maps"]["maps_placement"] == v and d[v]["maps"]["maps_bytes"] > 0
        assert d[v]["stats"]["100"]["tail"] == 8 and d[v]["ttft_s"]["100"] > 0
    assert "vs stock" in run.stdout


def test_benchmark_bad_input(cli, tiny_models):
    r = cli("bench", tiny_models["llama"], "--lengths", "4096")
    assert r.exit_code == 1 and "longer than the model's context (2048)" in r.output
    r = cli("bench", tiny_models["llama"], "--lengths", "a,b")
    assert r.exit_code == 1 and "comma-separated integers" in r.output
    r = cli("bench", tiny_models["llama"], "--split", 6)
    assert r.exit_code == 1 and "split 6 outside 1..5" in r.output


def test_demo_runs_on_a_tiny_model(tiny_models, cli, tmp_path, monkeypatch):
    """The README's first command, end to end on a tiny model: fit, the long prompt both ways, generation."""
    monkeypatch.setenv("RIDGEFILL_CACHE", str(tmp_path))
    r = cli("demo", "--model", tiny_models["llama"], "--fit-tokens", 3000, "--long-tokens", 1200,
            "--max-tokens", 4, "--threads", 1)
    assert r.exit_code == 0, r.output
    assert (tmp_path / "maps" / "tiny-llama.ridgefill.gguf").is_file()
    assert "RidgeFill:" in r.output and "rows filled" in r.output and "ceiling 1/r" in r.output


def test_gpu_check_and_state_correction_tools_run_on_a_cpu_build(tmp_path):
    """tools/measure/gpu_h200_check.py (the H200 figures of docs/gpu-h200) and tools/measure/results_state_correction.py
    run end to end on a CPU build: every architecture's RidgeFill prefill agrees with the oracle at
    float32 rounding here, on the window-sized sliding-window cache too, and the state-correction report
    covers the tiny hybrid's mapped GDN layer."""
    import subprocess
    import sys
    from pathlib import Path

    tools = Path(__file__).resolve().parents[1] / "tools" / "measure"
    run = subprocess.run([sys.executable, str(tools / "gpu_h200_check.py"), "--out", str(tmp_path / "gpu"), "--n-gpu-layers", "0",
                          "--skip-speed"], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    d = json.loads((tmp_path / "gpu" / "gpu-check.json").read_text())
    assert set(d["agreement"]) == {"llama", "qwen3", "gemma3", "qwen35"}
    for arch, r in d["agreement"].items():
        assert "error" not in r, (arch, r)
        tol = 1e-3 if arch == "gemma3" else 1e-5  # gemma3: llama.cpp's CPU GELU is an F16 table
        assert r["stock_vs_oracle"] < tol and r["ridgefill_resident_vs_oracle"] < tol, (arch, r)
        assert r["ridgefill_host_vs_oracle"] == r["ridgefill_resident_vs_oracle"]
    assert d["agreement"]["qwen35"]["states_resident_vs_oracle"] < 1e-5
    assert d["agreement"]["qwen35"]["state_correction_vs_oracle"] < 1e-5
    # the window-sized sliding-window cache: rows left the 256-cell cache, exact rows ran in window graphs
    assert set(d["window"]) == {"gemma3", "gpt-oss"}
    for arch, r in d["window"].items():
        assert "error" not in r, (arch, r)
        tol = 1e-3 if arch == "gemma3" else 1e-5
        assert r["window"]["graphs"] > 0 and r["window"]["scratch_cells"] == 256, (arch, r)
        assert r["stock_window_vs_oracle"] < tol and r["ridgefill_window_vs_oracle"] < tol, (arch, r)
        assert r["window_vs_full"] < 1e-4, (arch, r)

    out = tmp_path / "statecorr.json"
    run = subprocess.run([sys.executable, str(tools / "results_state_correction.py"), "--windows", "2", "--ctx", "256",
                          "--tail", "32", "--calib-tokens", "6000", "--json", str(out)], capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    d = json.loads(out.read_text())
    assert list(d["gains"]) == ["4"] and len(d["gains"]["4"]) == 4 and all(g > 0 for g in d["gains"]["4"])
    for k in ("without", "with"):
        assert len(d["boundary_rel_error"]["4"][k]) == 2 and len(d["kl_last_row"][k]) == 2
    assert "boundary state" in run.stdout


def test_plan_accounting_and_arch_bench_tools_run(tmp_path):
    """tools/measure/overhead_cpu.py (docs/overhead-cpu) and tools/measure/archs_cpu.py (docs/archs-cpu) run end to
    end on short prompts: the accounting's graph counts follow the plan (700 rows: two ubatches, each
    building its graph, the second holding the selector's query rows; some late graphs), with a stock
    prefill of the same prompt beside it; the bench reports every arch it ran."""
    import subprocess
    import sys
    from pathlib import Path

    tools = Path(__file__).resolve().parents[1] / "tools" / "measure"
    out = tmp_path / "acct.json"
    run = subprocess.run([sys.executable, str(tools / "overhead_cpu.py"), "--shape", "small", "--lengths", "700",
                          "--threads", "1", "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    (row,) = json.loads(out.read_text())
    assert row["graphs"]["early_built"] == 2 and row["graphs"]["early_reused"] == 0  # 700 rows, ubatches of 512
    assert row["graphs"]["late_built"] > 0 and row["times_ms"]["late"] > 0
    assert row["stock"]["graphs"] == {"built": 2, "reused": 0} and row["stock"]["prefill_ms"] > 0  # 512 + 188 rows
    assert row["late_rows"]["attention"] == 512 and "| small | 700 |" in run.stdout
    out = tmp_path / "archs.json"
    run = subprocess.run([sys.executable, str(tools / "archs_cpu.py"), "--arch", "qwen2", "--lengths", "300",
                          "--repeats", "1", "--threads", "1", "--json", str(out)], capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    (res,) = json.loads(out.read_text())
    assert res["arch"] == "qwen2" and res["rows"][0]["n"] == 300 and res["rows"][0]["speedup"] > 0


def test_bench_checks_the_maps_against_the_model_as_eval_does(cli, tiny_models, tmp_path, monkeypatch):
    """Maps of another model (30 layers, like SmolLM2's) or another checkpoint: bench says the maps do
    not fit, in eval's words, before it loads anything."""
    from test_mapfile import _maps

    from ridgefill_cpp.fitting import capture
    from ridgefill_cpp.maps.fingerprint import model_fingerprint
    from ridgefill_cpp.maps.mapfile import write_map_file

    def no_model(*a, **k):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(capture, "open_model", no_model)

    tiny = tiny_models["llama"]
    deeper = write_map_file(tmp_path / "other.gguf", _maps(n_embd=64, split=20, n_layer=30, fingerprint="sha256:x"))
    checkpoint = write_map_file(tmp_path / "seed1.gguf", _maps(n_embd=64, split=3, n_layer=6, fingerprint="sha256:x"))
    assert model_fingerprint(tiny) != "sha256:x"
    for maps, problem in ((deeper, "layers: maps are for 30, the model has 6"), (checkpoint, "another checkpoint")):
        texts = {}
        for command in ("bench", "eval"):
            r = cli(command, tiny, "--maps", maps, "--lengths", "256", "--out" if command == "eval" else "--repeats",
                    tmp_path / "report" if command == "eval" else 1)
            assert r.exit_code == 1, (command, r.output)
            texts[command] = " ".join(r.output.split())
        for text in texts.values():
            assert f"{maps}: the maps do not fit {tiny}: " in text and problem in text, texts
        assert "outside 1..5" not in texts["bench"]


def test_output_paths_are_checked_before_any_work(cli, tiny_models, tmp_path, monkeypatch):
    """bench --json, eval --out and tune --out are checked first: a path that cannot be written ends
    the command at once with a clear error, not after the whole run."""
    from ridgefill_cpp.quality import bench
    from ridgefill_cpp.quality import evaluate
    from ridgefill_cpp.quality import tune

    def no_work(*a, **k):
        raise AssertionError("the work started")

    for mod, name in ((bench, "benchmark_prefill"), (evaluate, "evaluate"), (tune, "tune")):
        monkeypatch.setattr(mod, name, no_work)
    tiny = tiny_models["llama"]
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    link = tmp_path / "link.json"
    link.symlink_to(a_file)
    maps = tmp_path / "m.gguf"
    cases = [
        (("bench", tiny, "--json", tmp_path / "no" / "such" / "x.json"), "is not a writable directory"),
        (("bench", tiny, "--json", link), f"{link} is a symbolic link, not a regular file"),
        (("eval", tiny, "--maps", maps, "--out", a_file / "report"), "is not a writable directory"),
        (("eval", tiny, "--maps", maps, "--out", a_file), "exists and is not a directory"),
        (("tune", tiny, "--maps", maps, "--budget", 0.1, "--out", a_file / "tuned"), "is not a writable directory"),
    ]
    for args, message in cases:
        r = cli(*args)
        assert r.exit_code == 1 and message in " ".join(r.output.split()), (args, r.output)
    assert a_file.read_text() == "x" and link.is_symlink()


def test_bench_and_eval_use_the_map_files_tuned_defaults_as_serve_and_llama_do(cli, tiny_models, tmp_path, monkeypatch):
    """T, exact fraction and selector left unset come from the map file's tuned defaults (then the
    built-in ones), as in ``RidgeFill(path)`` and ``serve``; an option always wins. (bench and eval
    used the built-in 64 / 0.1 / attention whatever the file said.)"""
    from test_mapfile import _maps

    from ridgefill_cpp.quality import bench

    from ridgefill_cpp.quality import evaluate
    from ridgefill_cpp.maps.fingerprint import model_fingerprint
    from ridgefill_cpp.maps.mapfile import write_map_file, write_tuned_defaults
    from ridgefill_cpp.runtime.prefill import RidgeFill

    class Stop(Exception):
        pass

    seen = {}

    def capture_bench(model, **kw):
        seen["bench"] = (kw["tail"], kw["exact_fraction"], kw["selector"])
        raise Stop

    def capture_eval(model, maps, options, **kw):
        seen["eval"] = (options.tail, options.exact_fraction, options.selector)
        seen["eval swa_full"] = options.swa_full
        raise Stop

    monkeypatch.setattr(bench, "benchmark_prefill", capture_bench)
    monkeypatch.setattr(evaluate, "evaluate", capture_eval)
    tiny = tiny_models["llama"]
    plain = write_map_file(tmp_path / "plain.gguf", _maps(n_embd=64, split=3, n_layer=6, fingerprint=model_fingerprint(tiny)))
    tuned = tmp_path / "tuned.gguf"
    tuned.write_bytes(plain.read_bytes())
    write_tuned_defaults(tuned, {"tail": 12, "exact_fraction": 0.25, "selector": "none", "budget": 0.02})
    library = RidgeFill(tuned)
    assert (library.tail, library.exact_fraction, library.selector) == (12, 0.25, "none")

    def run(command, maps, *opts):
        extra = ("--out", tmp_path / "r") if command == "eval" else ("--repeats", 1)
        seen.pop(command, None)
        r = cli(command, tiny, "--maps", maps, "--lengths", "256", *extra, *opts)
        assert isinstance(r.exception, Stop), r.output
        return seen[command], " ".join(r.output.split())

    for command in ("bench", "eval"):
        got, text = run(command, tuned)
        assert got == (12, 0.25, "none"), command
        assert "the map file's tuned defaults: tail 12, exact_fraction 0.25, selector none" in text, text
        got, _ = run(command, tuned, "--tail", 32, "--selector", "probe")
        assert got == (32, 0.25, "probe"), command
        got, text = run(command, plain)
        assert got == (64, 0.10, "attention") and "tuned defaults" not in text, command
    assert seen["eval swa_full"] is True  # libllama's default: a full-size sliding-window cache
    run("eval", plain, "--no-swa-full")
    assert seen["eval swa_full"] is False


def test_llama_cpp_log_lines_stay_out_of_the_output_unless_verbose(tiny_models, tmp_path):
    """``ridgefill-gguf bench`` on a model with sliding-window layers printed llama.cpp's
    ``llama_kv_cache_iswa: using full-size SWA cache`` above its table with verbose=False: llama-cpp-python's
    table of llama.cpp's log levels predates the pinned tree's (a warning read as an error). The
    command line is quiet by default and shows llama.cpp's log with ``--verbose``; ``Llama(verbose=False)``
    shows errors only, ``verbose=True`` everything (a fresh process each, as a user runs them)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import ridgefill_cpp

    env = dict(os.environ, PYTHONPATH=str(Path(ridgefill_cpp.__file__).resolve().parent.parent))
    model = str(tiny_models["gemma3"])
    bench = ["bench", model, "--lengths", "80", "--repeats", "1", "--threads", "1", "--min-prompt", "50", "--tail", "8"]

    def run(*args: str) -> subprocess.CompletedProcess:
        code = "import sys\nfrom ridgefill_cpp.cli import app\nsys.argv[0] = 'ridgefill-gguf'\napp()"
        return subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, timeout=300)

    quiet = run(*bench)
    assert quiet.returncode == 0, quiet.stderr[-2000:]
    assert "llama_" not in quiet.stdout + quiet.stderr and "ceiling" in quiet.stdout, quiet.stdout + quiet.stderr
    loud = run("--verbose", *bench)
    assert loud.returncode == 0 and "using full-size SWA cache" in loud.stderr and "ceiling" in loud.stdout

    for verbose, shown in ((False, False), (True, True)):
        code = ("import ridgefill_cpp\nfrom ridgefill_cpp import Llama\n"
                f"Llama({model!r}, n_ctx=256, swa_full=True, verbose={verbose}).close()\nprint('done')")
        proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0 and proc.stdout == "done\n", proc.stderr[-2000:]
        assert ("using full-size SWA cache" in proc.stderr) == shown, proc.stderr[-2000:]


def test_gpu_run_dry_run_on_the_cpu(tmp_path):
    """tools/measure/gpu_h200.py, the device run of a GPU lease (docs/gpu-h200, issue #32), with --dry-run: the
    same shapes' structure at tiny sizes on the CPU backend, so that the script cannot rot between
    leases. Every section runs and reports: TTFT of stock, RidgeFill, its variants (a fixed early
    extent; host-built KQ masks) and the first S layers, with the plan's statistics; the per-ubatch
    timeline (one entry per ubatch, split into the host's call and the wait for the device; the RidgeFill
    run's last one holds the late phase); resident against host-placed maps; and the model files removed
    after each shape."""
    import subprocess
    import sys
    from pathlib import Path

    tools = Path(__file__).resolve().parents[1] / "tools" / "measure"
    out = tmp_path / "gpu-run"
    run = subprocess.run([sys.executable, str(tools / "gpu_h200.py"), "--dry-run", "--out", str(out), "--repeats", "1",
                          "--n-gpu-layers", "0"], capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    d = json.loads((out / "gpu-run.json").read_text())
    assert d["dry_run"] and [s["shape"] for s in d["shapes"]] == ["8b-dense-32", "9b-hybrid-12", "8b-dense-12"]
    for sh in d["shapes"]:
        assert "error" not in sh, sh
        assert [r["n"] for r in sh["rows"]] == [256, 512]
        for r in sh["rows"]:
            variants = ("ridgefill, early graphs 4", "ridgefill, host masks")
            assert set(r["median_s"]) == {"stock", "ridgefill", f"first {sh['split']} layers", *variants,
                                          *(f"stock ({v} runs)" for v in variants)}
            assert set(r["variant_speedups"]) == set(variants)
            assert r["ridgefill"]["n_filled"] > 0 and r["ceiling"] > 1.0
            assert set(r["ridgefill"]["times_ms"]) == {"early", "late", "build", "alloc", "set_input", "compute", "wait", "other"}
            # LLAMA_RIDGEFILL_EARLY_GRAPHS=4 reached the context: no more early graphs built than its steps
            # and the selector's ubatches
            assert r["ridgefill, early graphs 4"]["graphs"]["early_built"] <= 4 + 2, r["ridgefill, early graphs 4"]
            # the CPU backend: host masks by default; LLAMA_RIDGEFILL_GRAPH_MASK=0 reached the context too
            assert r["ridgefill"]["kq_mask"] == r["ridgefill, host masks"]["kq_mask"] == "host"
        tl = sh["timeline"]
        assert tl["n"] == 512 and len(tl["ridgefill"]) == len(tl["stock"]) == len(tl[f"first {sh['split']} layers"]) == 8
        assert tl["early_ms"] > 0 and tl["first_layers_ms"] > 0
        # each ubatch split into the host's call and the wait for the device after it, which add up to it
        for v, total in ((v, tl[v]) for v in tl["host_ms"]):
            host, wait = tl["host_ms"][v], tl["device_wait_ms"][v]
            assert len(host) == len(wait) == 8 and all(h > 0 and w >= 0 for h, w in zip(host, wait))
            assert np.allclose(total, np.add(host, wait))
        assert set(tl["host_bound_ubatches"]) == set(tl["host_ms"]) == {"ridgefill", *variants, "stock",
                                                                        f"first {sh['split']} layers"}
    p = d["placement"]
    assert "error" not in p and p["maps_bytes"] > 0 and set(p["median_s"]) == {"resident", "host"}
    md = (out / "gpu-run.md").read_text()
    assert "## 8b-dense-32 (S = 5 of 8; RidgeFill's KQ masks: host)" in md and "Timeline at 512 rows" in md and "## Map placement" in md
    assert "| stock | " in md and "host-bound ubatches" in md
    # fit on the device (--n-gpu-layers; here 0), after the first two shapes: the capture's speed beside
    # the plain prefill of the same windows, the fit's timings and its estimate after the first windows
    f = d["fit"]
    assert "error" not in f, f
    assert f["shape"] == "8b-dense-12" and f["n_gpu_layers"] == 0 and f["layer_devices"][0].startswith("CPU")
    assert f["tokens"] >= 5000 and f["windows"] >= 10 and f["capture_tok_s"] > 0 and f["prefill_tok_s"] > 0
    assert f["forward_s"] > 0 and f["solve_s"] > 0 and f["estimate"]["seconds"] > 0 and len(f["r2"]) == 1
    assert f["estimate"]["peak_bytes"] > f["estimate"]["rss_bytes"]
    assert "## fit on the device (8b-dense-12, S = 4, --n-gpu-layers 0: CPU" in md
    # each shape's model files are removed once it is measured (the device's disk holds 64 GiB)
    tmp = Path(next(line for line in run.stdout.splitlines() if line.startswith("gpu-run: model files in ")).split(" in ", 1)[1])
    assert all(f"gpu-run: {name}: " in run.stdout for name in ("8b-dense-32", "8b-dense-12", "9b-hybrid-12"))
    assert not tmp.exists()


# ------------------------------------------------------------------------------------------------
# when a timing cannot be trusted (issue #53): a speedup above its ceiling, repeats far apart


def test_timing_warnings_on_hand_made_timings():
    from ridgefill_cpp.quality.bench import SPREAD_LIMIT, spread, timing_warnings

    assert SPREAD_LIMIT == 1.10
    # the run: stock's two repeats 151 s and 97 s, RidgeFill 1.85x against a ceiling of 1.40x
    ws = timing_warnings({"stock": [151.0, 97.0], "ridgefill": [67.0, 67.2]}, {"ridgefill": 1.40}, n_prompt=4096)
    assert [(w["variant"], w["kind"]) for w in ws] == [("stock", "spread"), ("ridgefill", "above ceiling")]
    assert ws[0]["spread"] == pytest.approx(151 / 97 - 1) and (ws[0]["min_s"], ws[0]["max_s"]) == (97.0, 151.0)
    assert ws[1]["speedup"] == pytest.approx(124 / 67.1) and ws[1]["ceiling"] == 1.40
    assert ws[0]["message"].startswith("4096 tokens, stock: its 2 repeats differ by 56 % (97 s to 151 s")
    assert "1.85x is above its ceiling 1.40x" in ws[1]["message"]
    for w in ws:
        assert "more --repeats" in w["message"] and "quieter machine (nothing else running)" in w["message"]
    # 100 s and 105 s: 5 % apart, under the ceiling: nothing to say
    assert timing_warnings({"stock": [100.0, 105.0], "ridgefill": [80.0, 81.0]}, {"ridgefill": 1.40}) == []
    # 10 % is the limit, not past it; 11 % is
    assert timing_warnings({"stock": [100.0, 110.0]}, {}) == []
    assert [w["kind"] for w in timing_warnings({"stock": [100.0, 111.0]}, {})] == ["spread"]
    # one repeat: its spread is unknown, never a spread warning; the ceiling still holds
    assert spread([97.0]) is None and spread([100.0, 105.0]) == pytest.approx(0.05)
    ws = timing_warnings({"stock": [151.0], "ridgefill": [60.0]}, {"ridgefill": 1.40})
    assert [(w["variant"], w["kind"]) for w in ws] == [("ridgefill", "above ceiling")]
    assert timing_warnings({"stock": [151.0], "ridgefill": [120.0]}, {"ridgefill": 1.40}) == []
    # the ceiling as printed: 1.401x against 1.40x is not above it; no ceiling (None, or the base): no rule
    assert timing_warnings({"stock": [140.1], "ridgefill": [100.0]}, {"ridgefill": 1.40}) == []
    assert timing_warnings({"stock": [300.0], "x": [100.0]}, {"x": None, "stock": 0.5}) == []
    # times that are not repeats of one prompt (eval's, tune's documents): only the ceiling rule
    ws = timing_warnings({"exact": [2.0, 1.0], "ridge": [0.5, 1.5]}, {"ridge": 1.2}, base="exact", repeats=False,
                         more=None)
    assert [(w["variant"], w["kind"]) for w in ws] == [("ridge", "above ceiling")]
    assert "more" not in ws[0]["message"] and "Run again on a quieter machine" in ws[0]["message"]


def _fake_bench(tiny, repeats: int):
    """A BenchResult with the issue's timings at 4096 tokens and quiet ones at 2048 (nothing measured)."""
    from ridgefill_cpp.quality.bench import BenchResult

    times = ({"stock": {2048: [100.0, 105.0], 4096: [151.0, 97.0]}, "identity": {2048: [80.0, 82.0], 4096: [66.0, 67.0]}}
             if repeats == 2 else {"stock": {2048: [100.0], 4096: [151.0]}, "identity": {2048: [80.0], 4096: [66.0]}})
    return BenchResult(model=str(tiny), n_layer=30, split=20, tail=64, exact_fraction=0.1, selector="attention",
                       min_prompt=1024, maps=None, threads=None, n_batch=512, repeats=repeats, lengths=[2048, 4096],
                       times=times, ceiling={2048: 1.40, 4096: 1.40}, kl={"identity": {2048: 0.01, 4096: 0.02}},
                       greedy_agree={"identity": {2048: 8, 4096: 8}}, greedy_tokens=8)


def test_bench_says_when_a_timing_is_noise(cli, tiny_models, tmp_path, monkeypatch):
    """bench's table shows stock's tokens/s and each variant's spread of repeats; a speedup above its
    ceiling and repeats more than 10 % apart are warned of below it and listed in the JSON (the timings
    are the issue's, made by hand: nothing is timed here)."""
    from ridgefill_cpp.cli.app import out as console
    from ridgefill_cpp.quality import bench

    tiny = tiny_models["llama"]
    monkeypatch.setattr(console, "width", 250)  # a table row on one line
    for repeats in (2, 1):
        monkeypatch.setattr(bench, "benchmark_prefill", lambda model, **kw: _fake_bench(tiny, repeats))
        path = tmp_path / f"bench{repeats}.json"
        r = cli("bench", tiny, "--lengths", "2048,4096", "--repeats", repeats, "--json", path)
        assert r.exit_code == 0, r.output
        text = " ".join(r.output.split())
        d = json.loads(path.read_text())
        assert "stock tokens/s" in r.output
        assert [row["tokens_per_s[stock]"] for row in d["summary"]] == pytest.approx(
            [2048 / (102.5 if repeats == 2 else 100.0), 4096 / (124.0 if repeats == 2 else 151.0)])
        speedup = "1.86x" if repeats == 2 else "2.29x"  # 124 s / 66.5 s, 151 s / 66 s
        assert (f"warning: 4096 tokens, identity: the speedup {speedup} is above its ceiling 1.40x, which no prefill "
                "reaches: the timing is noise, not a speedup. Run again with more --repeats, on a quieter machine "
                "(nothing else running).") in text
        assert "2048 tokens" not in text  # 1.27x (2 repeats) and 1.25x (1), under 1.40x; 5 % and 2.5 % apart
        if repeats == 2:
            assert "│ 4096 │ 124000 ms (56 %) │ 33 │ 66500 ms (2 %) │ 1.86x │ 1.40x │ 1.33 │" in text
            assert "│ 2048 │ 102500 ms (5 %) │ 20 │ 81000 ms (2 %) │ 1.27x │ 1.40x │ 0.90 │" in text
            assert ("warning: 4096 tokens, stock: its 2 repeats differ by 56 % (97 s to 151 s; more than 10 %): "
                    "its median is noisy. Run again with more --repeats, on a quieter machine (nothing else running).") in text
            assert [(w["n_prompt"], w["variant"], w["kind"]) for w in d["timing_warnings"]] == [
                (4096, "stock", "spread"), (4096, "identity", "above ceiling")]
            assert d["summary"][1]["spread[stock]"] == pytest.approx(151 / 97 - 1)
            assert d["summary"][0]["spread[identity]"] == pytest.approx(82 / 80 - 1)
            assert d["timing_notes"] == [] and "one repeat" not in text
        else:
            assert "│ 4096 │ 151000 ms │ 27 │ 66000 ms │ 2.29x │ 1.40x │ 1.63 │" in text
            assert [(w["variant"], w["kind"]) for w in d["timing_warnings"]] == [("identity", "above ceiling")]
            assert d["summary"][1]["spread[stock]"] is None and "repeats differ" not in text
            assert ("one repeat: the spread of the times is unknown (a single repeat cannot show noise); use "
                    "--repeats 3 or more to see it") in text and d["timing_notes"] == [bench.SINGLE_REPEAT_NOTE]
