"""``ridgefill-gguf tune`` (issue #8, item 4): the automatic operating point, its selection logic,
the tuned defaults in the map file and their use by ``RidgeFill`` / ``Llama``.

Timing on tiny models is noise: nothing here asserts on a measured time or speedup, only on what
the selection does with the numbers that were measured."""

from __future__ import annotations

import ctypes
import hashlib
import json
import math
import re
import shutil
import stat

import pytest
from conftest import evaluation_tokens

import ridgefill_cpp.core.native as N
from ridgefill_cpp import Llama, RidgeFill
from ridgefill_cpp.fitting import corpus
from ridgefill_cpp.fitting.fit import FitOptions, fit_ridge_maps
from ridgefill_cpp.core.gguf_model import read_header, read_metadata
from ridgefill_cpp.maps.mapfile import (TUNED_PREFIX, MapFileError, compatibility_problems, read_map_file,
                                   read_tuned_defaults, tuned_defaults_from_metadata, write_map_file,
                                   write_tuned_defaults)
from ridgefill_cpp.quality.tune import (NoFeasibleSetting, TuneOptions, TunePoint, check_grid, check_key_rescales, check_spans,
                                choose, is_feasible, pareto_front, tune, tune_markdown)

# tails too short for the retrieval question: the retrieval check is off here, and on in its own tests
OPTS = dict(tails=(8, 16), fractions=(0.0, 0.5), length=256, n_docs=3, n_threads=1, n_boot=300, retrieval_prompts=0)
CLI_GRID = ("--tails", "8,16", "--fractions", "0,0.5", "--length", 256, "--docs", 3, "--threads", 1,
            "--retrieval-prompts", 0)


def _sha(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


@pytest.fixture(scope="module")
def fitted(tiny_models, tmp_path_factory):
    """Map files of the tiny llama model for S = 4 and S = 3 (never modified: tests copy them)."""
    root = tmp_path_factory.mktemp("tune-maps")
    out = {}
    for split in (4, 3):
        fit = fit_ridge_maps(tiny_models["llama"], corpus.default_documents("calibration"),
                             FitOptions(n_tokens=3000, ctx=128, split=split, n_threads=1))
        out[split] = write_map_file(root / f"tiny.S{split}.gguf", fit.maps)
    return out


def _copies(fitted, dst, splits=(4, 3)):
    out = []
    for s in splits:
        p = dst / f"tiny.S{s}.ridgefill.gguf"
        shutil.copyfile(fitted[s], p)
        out.append(p)
    return out


@pytest.fixture(scope="module")
def tuned(tiny_models, fitted, tmp_path_factory):
    """One tune run over two map files with a budget every setting meets."""
    root = tmp_path_factory.mktemp("tuned")
    maps = _copies(fitted, root)
    before = {str(p): _sha(p) for p in maps}
    model_sha = _sha(tiny_models["llama"])
    res = tune(tiny_models["llama"], maps, 10.0, TuneOptions(**OPTS))
    return res, maps, before, model_sha


# ------------------------------------------------------------------------------------------------
# pure selection logic


def test_pareto_front_on_hand_made_points():
    # (speedup, ΔNLL): faster is better, lower ΔNLL is better
    pts = [(1.2, 0.010),   # 0: front
           (1.5, 0.030),   # 1: front
           (1.1, 0.020),   # 2: dominated by 0 (slower and worse)
           (1.5, 0.040),   # 3: dominated by 1 (as fast, worse)
           (1.0, 0.010),   # 4: dominated by 0 (as good, slower)
           (1.8, 0.100),   # 5: front (fastest)
           (1.2, 0.010),   # 6: equal to 0: neither dominates, both on the front
           (0.9, -0.01),   # 7: front (best ΔNLL)
           (float("nan"), 0.0),  # 8: never on the front
           (2.0, float("nan"))]  # 9: never on the front
    assert pareto_front(pts) == [7, 0, 6, 1, 5]
    assert pareto_front([]) == []
    assert pareto_front([(1.0, 0.5)]) == [0]


def _pt(speedup, delta, ceiling=1.5, high=None, label=0) -> TunePoint:
    p = TunePoint("m", 3, 8 + label, 0.1, "attention", speedup=speedup, ceiling=ceiling)
    if delta is not None:
        p.novel = {"estimate": delta, "low": delta - 0.01, "high": delta + 0.01 if high is None else high, "n": 3}
    return p


def test_feasibility_and_choice():
    assert is_feasible(_pt(1.0, 0.02), 0.02) and not is_feasible(_pt(1.0, 0.021), 0.02)
    assert not is_feasible(_pt(1.0, 0.01, high=0.03), 0.02, strict=True)
    assert is_feasible(_pt(1.0, 0.01, high=0.02), 0.02, strict=True)
    assert not is_feasible(_pt(1.0, None), 1.0)  # no novel token scored
    nan_ci = _pt(1.0, 0.0)
    nan_ci.novel["high"] = float("nan")
    assert not is_feasible(nan_ci, 1.0, strict=True) and is_feasible(nan_ci, 1.0)

    def chosen(points, budget=0.05):
        for p in points:
            p.feasible = is_feasible(p, budget)
        return choose(points)

    # the fastest feasible one, not the fastest
    assert chosen([_pt(1.3, 0.01), _pt(1.9, 0.2), _pt(1.6, 0.04)]) == 2
    # speed tie: higher ceiling, then lower ΔNLL, then grid order
    assert chosen([_pt(1.5, 0.01, ceiling=1.4), _pt(1.5, 0.03, ceiling=1.6)]) == 1
    assert chosen([_pt(1.5, 0.03), _pt(1.5, 0.01)]) == 1
    assert chosen([_pt(1.5, 0.01, label=1), _pt(1.5, 0.01, label=2)]) == 0
    assert chosen([_pt(1.5, 0.2), _pt(1.2, 0.1)]) is None


def test_grid_checks():
    assert check_grid([16, 8, 8], [0.1, 0, 0.1], 256) == ((8, 16), (0.0, 0.1))
    for tails, fractions, length, msg in [([], [0.1], 256, "no tails"), ([8], [], 256, "no exact fractions"),
                                          ([0], [0.1], 256, "tails must be integers >= 1"),
                                          ([8.5], [0.1], 256, "tails must be integers"),
                                          ([8], [1.5], 256, r"exact fraction 1\.5 outside \[0, 1\]"),
                                          ([8], [-0.1], 256, "outside"),
                                          ([8, 64], [0.1], 256, "tail 64 is not below length/4")]:
        with pytest.raises(ValueError, match=msg):
            check_grid(tails, fractions, length)


# ------------------------------------------------------------------------------------------------
# end to end


def test_tune_chooses_the_fastest_feasible_setting(tuned, tiny_models):
    res, maps, before, model_sha = tuned
    assert res.splits == [4, 3] and res.scored_rows == 8
    assert len(res.points) == 2 * 2 * 2 and len(res.documents) == 3 and len(res.exact_times) == 3
    assert {(p.split, p.tail, p.exact_fraction) for p in res.points} == {
        (s, t, f) for s in (4, 3) for t in (8, 16) for f in (0.0, 0.5)}
    for p in res.points:
        assert len(p.times) == 3 and len(p.docs) == 3
        assert p.novel["n"] == 3 and p.novel["low"] <= p.novel["estimate"] <= p.novel["high"]
        assert p.all["n"] == 3 and p.tokens == 3 * res.scored_rows
        assert p.speedup > 0 and math.isfinite(p.speedup) and p.ceiling >= 1.0
        assert p.feasible == is_feasible(p, res.budget)
        # the same positions for every setting: as many scored (and novel) tokens
        assert p.novel_tokens == res.points[0].novel_tokens == sum(d["novel_tokens"] for d in res.documents)
    # exact fraction 0 selects no prefix row, 0.5 half of the prefix
    assert all((p.n_exact == 0) == (p.exact_fraction == 0.0) for p in res.points)

    # the choice, recomputed from the returned numbers
    feasible = [i for i, p in enumerate(res.points) if p.feasible]
    assert feasible and res.chosen in feasible
    best = max(res.points[i].speedup for i in feasible)
    assert res.best.speedup == best
    assert res.chosen == choose(res.points)
    # the front, recomputed
    front = pareto_front([(p.speedup, p.delta) for p in res.points])
    assert res.front == front and front
    assert [i for i, p in enumerate(res.points) if p.on_front] == sorted(front)
    for i in front:  # nobody dominates a front point
        a = res.points[i]
        assert not any(b.speedup >= a.speedup and b.delta <= a.delta and (b.speedup > a.speedup or b.delta < a.delta)
                       for b in res.points)
    # with the budget this large, the fastest setting of all is chosen, and it is on the front
    assert res.chosen in front and res.best.speedup == max(p.speedup for p in res.points)

    # written into the chosen map file only; the model and the other map file untouched
    chosen_path = res.best.maps
    assert res.written == str(maps[res.splits.index(res.best.split)].resolve())
    for p in maps:
        assert (_sha(p) == before[str(p)]) == (str(p) != chosen_path)
    assert _sha(tiny_models["llama"]) == model_sha
    d = json.loads(json.dumps(res.as_dict(), allow_nan=False))
    assert d["chosen"] == res.chosen and d["points"][res.chosen]["label"] == res.best.label


def test_tuned_metadata_round_trip_and_the_file_still_loads(tuned, tiny_models, fitted):
    res, maps, _, _ = tuned
    path = res.written
    t = read_tuned_defaults(path)
    best = res.best
    assert t["tail"] == best.tail and t["exact_fraction"] == best.exact_fraction and t["selector"] == "attention"
    assert t["budget"] == 10.0 and t["criterion"] == "estimate" and t["n_docs"] == 3 and t["length"] == 256
    assert t["delta_nll_novel"] == pytest.approx(best.delta) and t["speedup"] == pytest.approx(best.speedup)
    assert t["ceiling"] == pytest.approx(best.ceiling) and t["scored_rows"] == 8
    assert "evaluation split" in t["source"] and t["tool_version"] and t["date"].startswith("20")
    # every other key and every tensor unchanged
    orig_md, orig_t = read_header(fitted[best.split])
    new_md, new_t = read_header(path)
    assert {k: v for k, v in new_md.items() if not k.startswith(TUNED_PREFIX)} == orig_md
    raw0, raw1 = open(fitted[best.split], "rb").read(), open(path, "rb").read()
    assert [(x.name, x.shape, x.ggml_type) for x in orig_t] == [(x.name, x.shape, x.ggml_type) for x in new_t]
    for x, y in zip(orig_t, new_t):
        assert raw0[x.offset:x.offset + x.n_bytes] == raw1[y.offset:y.offset + y.n_bytes]
    # it loads everywhere: the reader, the compatibility check, the native loader
    assert read_map_file(path).meta.split_layer == best.split
    assert compatibility_problems(read_map_file(path).meta, tiny_models["llama"]) == []
    llm = Llama(str(tiny_models["llama"]), ridgefill=path, n_ctx=512, verbose=False)
    try:
        assert llm.ridgefill.tail == best.tail and llm.ridgefill.origin["tail"] == "map file"
    finally:
        llm.close()


def test_ridgefill_uses_tuned_defaults_and_arguments_win(tiny_models, fitted, tmp_path):
    (path,) = _copies(fitted, tmp_path, splits=(3,))
    rf = RidgeFill(path)
    assert (rf.tail, rf.exact_fraction, rf.selector) == (64, 0.10, "attention") and rf.tuned is None
    assert rf.origin == {"tail": "built-in", "exact_fraction": "built-in", "selector": "built-in", "span": "built-in",
                         "key_rescale": "built-in"}
    assert read_tuned_defaults(path) is None
    write_tuned_defaults(path, {"tail": 12, "exact_fraction": 0.25, "selector": "none", "budget": 0.02})
    rf = RidgeFill(path, min_prompt=0)
    assert (rf.tail, rf.exact_fraction, rf.selector) == (12, 0.25, "none")
    assert rf.tuned["budget"] == 0.02 and rf.span == 16 and rf.origin.pop("span") == "built-in"
    assert rf.key_rescale == 0 and rf.origin.pop("key_rescale") == "built-in"
    assert set(rf.origin.values()) == {"map file"}
    rf2 = RidgeFill(path, tail=5, selector=[3, 7], min_prompt=0)
    assert (rf2.tail, rf2.exact_fraction, rf2.selector, rf2.positions) == (5, 0.25, "positions", (3, 7))
    assert rf2.origin == {"tail": "argument", "exact_fraction": "map file", "selector": "argument", "span": "built-in",
                          "key_rescale": "built-in"}
    ident = RidgeFill.identity(3)
    assert (ident.tail, ident.exact_fraction, ident.selector, ident.tuned) == (64, 0.10, "attention", None)
    # the existing validation runs on the resolved values
    with pytest.raises(ValueError, match="at least the last prompt row must be exact"):
        RidgeFill(path, tail=0)

    from conftest import evaluation_tokens
    prompt = evaluation_tokens(tiny_models["llama"], 200)
    # selector none (from the file): no prefix row exact; attention at the file's 0.25: some; fraction 0: none
    for kw, tail, exact in [({}, 12, False), (dict(selector="attention"), 12, True),
                            (dict(tail=20, exact_fraction=0.0, selector="attention"), 20, False)]:
        llm = Llama(str(tiny_models["llama"]), ridgefill=RidgeFill(path, min_prompt=0, **kw), n_ctx=512,
                    verbose=False)
        try:
            llm.eval(prompt)
            st = llm.ridgefill_stats
            assert st["tail"] == tail and st["n_prompt"] == 200
            assert (st["n_exact"] > 0) == exact, (kw, st["n_exact"])
        finally:
            llm.close()
    # info shows them
    from ridgefill_cpp.cli import app
    from typer.testing import CliRunner

    r = CliRunner().invoke(app, ["info", str(path)])
    assert r.exit_code == 0 and "tuned defaults" in r.output and "selector none" in r.output, r.output
    r = CliRunner().invoke(app, ["info", "--json", str(path)])
    assert json.loads(r.output)["tuned"]["tail"] == 12
    # a path: Llama(..., ridgefill=path) uses them too
    llm = Llama(str(tiny_models["llama"]), ridgefill=str(path), n_ctx=512, verbose=False)
    try:
        assert (llm.ridgefill.tail, llm.ridgefill.exact_fraction, llm.ridgefill.selector) == (12, 0.25, "none")
    finally:
        llm.close()


def test_write_tuned_defaults_replaces_is_atomic_and_refuses(tiny_models, fitted, tmp_path, monkeypatch):
    import gguf

    (path,) = _copies(fitted, tmp_path, splits=(4,))
    path.chmod(0o640)
    write_tuned_defaults(path, {"tail": 16, "exact_fraction": 0.1, "selector": "attention", "budget": 0.02,
                                "source": "first"})
    write_tuned_defaults(path, {"tail": 32, "exact_fraction": 0.05, "selector": "none"})
    assert read_tuned_defaults(path) == {"tail": 32, "exact_fraction": 0.05, "selector": "none"}  # replaced, not merged
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    md = read_metadata(path)
    assert sum(k.startswith(TUNED_PREFIX) for k in md) == 3
    # a failure half-way leaves the original as it was, and no temporary file
    before = path.read_bytes()

    def boom(self, *a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", boom)
    with pytest.raises(OSError, match="disk full"):
        write_tuned_defaults(path, {"tail": 8, "exact_fraction": 0.0, "selector": "attention"})
    monkeypatch.undo()
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == [path.name]
    # refusals: nothing written
    model_sha = _sha(tiny_models["llama"])
    with pytest.raises(MapFileError, match="not a RidgeFill map file"):
        write_tuned_defaults(tiny_models["llama"], {"tail": 8, "exact_fraction": 0.0, "selector": "attention"})
    assert _sha(tiny_models["llama"]) == model_sha
    for bad, msg in [({"tail": 8, "exact_fraction": 0.0}, "tuned defaults without ridgefill.tuned.selector"),
                     ({"tail": 8, "exact_fraction": 2.0, "selector": "none"}, "outside"),
                     ({"tail": 0, "exact_fraction": 0.0, "selector": "none"}, "must be >= 1"),
                     ({"tail": 8, "exact_fraction": 0.0, "selector": "none", "colour": "red"}, "unknown tuned keys")]:
        with pytest.raises((ValueError, MapFileError), match=msg):
            write_tuned_defaults(path, bad)
    assert path.read_bytes() == before
    # malformed tuned keys in a file's metadata are refused with their name
    with pytest.raises(MapFileError, match="ridgefill.tuned.tail = 'x' is not a uint32"):
        tuned_defaults_from_metadata({TUNED_PREFIX + "tail": "x", TUNED_PREFIX + "exact_fraction": 0.1,
                                      TUNED_PREFIX + "selector": "none"})
    with pytest.raises(MapFileError, match="unknown tuned key ridgefill.tuned.speed"):
        tuned_defaults_from_metadata({TUNED_PREFIX + "speed": 2.0})


def test_dry_run_and_an_infeasible_budget_write_nothing(tiny_models, fitted, tmp_path):
    maps = _copies(fitted, tmp_path)
    before = [p.read_bytes() for p in maps]
    res = tune(tiny_models["llama"], maps, 10.0, TuneOptions(**OPTS), write=False)
    assert res.chosen is not None and res.written is None and res.defaults["tail"] == res.best.tail
    assert [p.read_bytes() for p in maps] == before
    # S = 4 fills rows of every document badly enough that no CI upper bound is within 1e-6 nats
    with pytest.raises(NoFeasibleSetting, match="no setting is within the budget of 1e-06 nats: the best novel-token "
                                                r"ΔNLL CI upper bound reached is \+") as e:
        tune(tiny_models["llama"], maps[:1], 1e-6, TuneOptions(**OPTS, strict=True))
    best = min(p.novel["high"] for p in e.value.result.points)
    assert f"{best:+.4f}" in str(e.value) and "nothing was written" in str(e.value)
    assert e.value.result.chosen is None and all(not p.feasible for p in e.value.result.points)
    assert [p.read_bytes() for p in maps] == before


def test_cli_tune_writes_the_plot_json_and_report(tiny_models, fitted, cli, tmp_path):
    maps = _copies(fitted, tmp_path)
    out = tmp_path / "out"
    model_sha = _sha(tiny_models["llama"])
    r = cli("tune", tiny_models["llama"], "--maps", maps[0], "--maps", maps[1], "--budget", 10, *CLI_GRID, "--out", out)
    assert r.exit_code == 0, r.output
    assert "chosen:" in r.output and "wrote the tuned defaults into" in r.output
    assert (out / "pareto.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    d = json.loads((out / "tune.json").read_text())
    assert d["chosen"] is not None and len(d["points"]) == 8 and d["budget"] == 10.0
    best = d["points"][d["chosen"]]
    assert d["written"] == best["maps"] and best["feasible"] and best["on_front"]
    t = read_tuned_defaults(best["maps"])
    assert (t["tail"], t["exact_fraction"]) == (best["tail"], best["exact_fraction"])
    md = (out / "tune.md").read_text()
    assert "**Chosen: " + best["label"] in md and "](pareto.png)" in md and "| split | T | fraction |" in md
    assert not list(out.glob(".*.tmp")) and _sha(tiny_models["llama"]) == model_sha

    # --dry-run --json: the result on stdout, nothing written
    before = [p.read_bytes() for p in maps]
    r = cli("tune", tiny_models["llama"], "--maps", maps[0], "--maps", maps[1], "--budget", 10, *CLI_GRID,
            "--dry-run", "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["written"] is None and d["defaults"]["tail"] == d["points"][d["chosen"]]["tail"] and d["error"] is None
    assert [p.read_bytes() for p in maps] == before


def test_cli_tune_selector_other_than_attention(tiny_models, fitted, cli, tmp_path):
    """--selector protected: every setting is measured with it and it is what the map file records."""
    maps = _copies(fitted, tmp_path)
    r = cli("tune", tiny_models["llama"], "--maps", maps[0], "--budget", 10, *CLI_GRID, "--selector", "protected",
            "--dry-run", "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert {p["selector"] for p in d["points"]} == {"protected"} and d["defaults"]["selector"] == "protected"


def test_cli_tune_bad_input(tiny_models, fitted, cli, tmp_path):
    maps = _copies(fitted, tmp_path)
    before = [p.read_bytes() for p in maps]
    out = tmp_path / "out"
    llama = tiny_models["llama"]
    cases = [
        (("--budget", 0), "--budget must be a positive number"),
        (("--budget", -0.5), "--budget must be a positive number"),
        (("--budget", 0.1, "--tails", ""), "--tails is empty"),
        (("--budget", 0.1, "--tails", "8,x"), "--tails must be comma-separated integers"),
        (("--budget", 0.1, "--fractions", "0,1.5"), r"exact fraction 1.5 outside \[0, 1\]"),
        (("--budget", 0.1, "--tails", "8,64", "--length", 256), "tail 64 is not below length/4"),
        (("--budget", 0.1, "--selector", "random"), r"--selector must be one of attention, attention\+protected, probe, protected, none"),
        (("--budget", 0.1, "--length", 4096, "--tails", "8"), "longer than the model's context"),
        (("--budget", 0.1, "--spans", "0"), "span 0 must be >= 1"),
        (("--budget", 0.1, "--spans", "4097"), "span 4097 must be <= 4096"),
        (("--budget", 0.1, "--spans", "1,4", "--selector", "protected"), "only attention, attention\\+protected, probe take a span"),
        (("--budget", 0.1, "--tails", "8", "--length", 256), "the retrieval question \\(57 tokens\\) does not fit a tail of 8 rows"),
    ]
    for args, msg in cases:
        r = cli("tune", llama, "--maps", maps[0], *args, "--out", out)
        assert r.exit_code == 1 and re.search(msg, " ".join(r.output.split())), (args, r.output)
    r = cli("tune", tiny_models["qwen3"], "--maps", maps[0], "--budget", 0.1, "--out", out)
    assert r.exit_code == 1 and "do not fit" in r.output and "architecture" in r.output
    r = cli("tune", llama, "--maps", maps[0], "--maps", fitted[4], "--budget", 0.1, "--out", out)
    assert r.exit_code == 1 and "two map files for the same split (S = 4)" in r.output
    r = cli("tune", llama, "--maps", llama, "--budget", 0.1, "--out", out)
    assert r.exit_code == 1 and "not a RidgeFill map file" in r.output
    # no setting within the budget: the table, then the error; nothing written
    r = cli("tune", llama, "--maps", maps[0], "--budget", 1e-6, "--strict", *CLI_GRID, "--out", out)
    said = " ".join(r.output.split())  # the table's title wraps
    assert r.exit_code == 1 and "no setting is within the budget" in said and "budget 1e-06 (CI upper bound)" in said
    assert [p.read_bytes() for p in maps] == before  # the report is written, the map files are not
    assert "**No setting is within the budget.**" in (out / "tune.md").read_text()


# ------------------------------------------------------------------------------------------------
# spans and the retrieval check (issue #17)

RETR = dict(tails=(60,), fractions=(0.0, 0.5), spans=(1, 4), length=256, n_docs=2, n_threads=1, n_boot=200,
            retrieval_prompts=3)


def test_tune_searches_spans_and_checks_retrieval(tiny_models, fitted, tmp_path):
    """Every (fraction, span) is measured and checked on the same retrieval prompts as exact prefill;
    the chosen span and the retrieval it kept go into the map file, and RidgeFill(path) uses the span."""
    (path,) = _copies(fitted, tmp_path, splits=(4,))
    res = tune(tiny_models["llama"], [path], 10.0, TuneOptions(**RETR))
    assert [(p.exact_fraction, p.span) for p in res.points] == [(0.0, 1), (0.0, 4), (0.5, 1), (0.5, 4)]
    assert [p.label for p in res.points][:2] == ["S=4 T=60 f=0 w=1", "S=4 T=60 f=0 w=4"]
    r = res.retrieval
    assert r["depths"] == [0.1, 0.5, 0.9] and r["codes"] == 2 and len(r["answers"]) == len(r["exact"]) == 3
    n_exact = sum(r["exact_correct"])
    for p in res.points:
        assert len(p.retrieval["correct"]) == len(p.retrieval["predictions"]) == 3
        kept = sum(c and e for c, e in zip(p.retrieval["correct"], r["exact_correct"]))
        assert p.retrieval["kept"] == [kept, n_exact]
        assert p.feasible == (p.novel["estimate"] <= 10.0 and kept == n_exact)
    t = read_tuned_defaults(path)
    best = res.best
    assert t["span"] == best.span and t["retrieval_prompts"] == 3
    assert (t["retrieval_exact"], t["retrieval_kept"]) == (n_exact, n_exact)
    rf = RidgeFill(path)
    assert rf.span == best.span and rf.origin["span"] == "map file"
    assert RidgeFill(path, span=7).span == 7  # an argument wins


def test_check_spans():
    assert check_spans([16, 1, 16], "attention") == (1, 16) and check_spans([8], "none") == (8,)
    for spans, selector, msg in [([], "attention", "no spans"), ([0], "attention", "must be >= 1"),
                                 ([4097], "probe", "must be <= 4096"), ([2.5], "attention", "must be an integer"),
                                 ([1, 4], "protected", "only attention, attention\\+protected, probe take a span")]:
        with pytest.raises(ValueError, match=msg):
            check_spans(spans, selector)


def test_a_setting_that_loses_a_code_is_not_feasible(tiny_models, fitted, tmp_path, monkeypatch):
    """The retrieval check decides: with exact prefill answering every prompt and every setting
    losing one, no setting is chosen however loose the budget, and the error says why."""
    import ridgefill_cpp.quality.tune as tune_mod

    def retrieval(llm, tokenize, bos, texts, n, options, conditions, tick):
        k = len(options.depths)
        return {c: {"correct": [rf is None or i > 0 for i in range(k)], "predictions": ["12345"] * k,
                    "answers": ["12345"] * k, "kept": [k if rf is None else k - 1, k]} for c, rf in conditions.items()}

    monkeypatch.setattr(tune_mod, "planted_code_retrieval", retrieval)
    (path,) = _copies(fitted, tmp_path, splits=(4,))
    before = path.read_bytes()
    with pytest.raises(NoFeasibleSetting, match=r"keeps retrieval: 4 within the budget lose planted codes .* keeps 2 of 3"):
        tune(tiny_models["llama"], [path], 10.0, TuneOptions(**RETR))
    assert path.read_bytes() == before
    p = TunePoint("m", 3, 60, 0.1, "attention", 4, novel={"estimate": 0.0, "low": 0.0, "high": 0.0, "n": 2})
    assert is_feasible(p, 0.1)
    p.retrieval = {"correct": [True, False], "predictions": [], "kept": [1, 2]}
    assert not is_feasible(p, 0.1)
    p.retrieval["kept"] = [2, 2]
    assert is_feasible(p, 0.1)


def test_cli_tune_spans_and_the_tuned_span_in_eval(tiny_models, fitted, cli, tmp_path):
    """tune --spans: the table and report show span and retrieval; bench and eval then use the
    file's tuned span (attention@W) unless the selector gives one."""
    (path,) = _copies(fitted, tmp_path, splits=(4,))
    out = tmp_path / "out"
    r = cli("tune", tiny_models["llama"], "--maps", path, "--budget", 10, "--tails", 60, "--fractions", "0,0.5",
            "--spans", "1,4", "--length", 256, "--docs", 2, "--retrieval-prompts", 2, "--threads", 1, "--out", out)
    assert r.exit_code == 0, r.output
    assert "retrieval" in r.output and re.search(r"span=[14]\b", r.output), r.output
    md = (out / "tune.md").read_text()
    assert "span in {1, 4}" in md and "| span |" in md and "retrieval kept |" in md and "retrieval check: 2 prompts" in md
    span = read_tuned_defaults(path)["span"]
    r = cli("info", path)
    assert r.exit_code == 0 and f"(span {span})" in r.output and "retrieval kept" in r.output, r.output
    r = cli("eval", tiny_models["llama"], "--maps", path, "--quick", "--docs", 0, "--depths", "0.5", "--retrieval-prompts",
            1, "--lengths", 256, "--tail", 60, "--threads", 1, "--out", tmp_path / "ev")
    assert r.exit_code == 0, r.output
    assert f"span {span}" in r.output  # the note on stderr: from the map file
    d = json.loads((tmp_path / "ev" / "results.json").read_text())
    assert d["options"]["selector"] == f"attention@{span}"
    assert f"ridge, attention@{span} selector" in d["retrieval"]["256"]


def test_tune_searches_key_rescales(tiny_models, fitted, tmp_path):
    """tune --key-rescales: each c_K is a setting of its own, measured with that key rescale (the
    same prompts give other losses than without it), and the chosen c_K goes into the map file."""
    (path,) = _copies(fitted, tmp_path, splits=(4,))
    opts = dict(OPTS, tails=(16,), fractions=(0.0,), key_rescales=(8, 0, 8))
    res = tune(tiny_models["llama"], [path], 10.0, TuneOptions(**opts))
    assert [p.key_rescale for p in res.points] == [0, 8] and res.options["key_rescales"] == [0, 8]
    assert [p.label for p in res.points] == ["S=4 T=16 f=0 w=16", "S=4 T=16 f=0 w=16 cK=8"]
    off, on = res.points
    assert [d["all"] for d in off.docs] != [d["all"] for d in on.docs]  # the key scales changed the filled keys
    t = read_tuned_defaults(path)
    assert t["key_rescale"] == res.best.key_rescale
    rf = RidgeFill(path)
    assert rf.key_rescale == res.best.key_rescale and rf.origin["key_rescale"] == "map file"
    assert RidgeFill(path, key_rescale=3).key_rescale == 3  # an argument wins
    md = tune_markdown(res)
    assert "key rescale c_K in {0, 8}" in md and "| c_K |" in md


def test_a_tuned_key_rescale_is_used_and_shown(tiny_models, fitted, cli, tmp_path):
    """A map file whose tuned point has a key rescale: Llama(ridgefill=path) measures the key scales,
    bench applies it to both fills, eval measures it as its variant, info shows it, and serve
    passes it to llama-server."""
    from ridgefill_cpp.quality.bench import benchmark_prefill
    from ridgefill_cpp.server.serve import server_args

    (path,) = _copies(fitted, tmp_path, splits=(4,))
    write_tuned_defaults(path, {"tail": 16, "exact_fraction": 0.0, "selector": "attention", "key_rescale": 8})
    rf = RidgeFill(path, min_prompt=0)
    # RidgeFill holds the resolved value and leaves the field unset for libllama, which takes the file's too
    assert rf.key_rescale == 8 and rf.params().n_key_rescale == N.LLAMA_RIDGEFILL_UNSET
    tokens = evaluation_tokens(tiny_models["llama"], 200)
    llm = Llama(str(tiny_models["llama"]), ridgefill=rf, n_ctx=512, n_threads=1, verbose=False)
    try:
        attached = N.llama_ridgefill_params()
        assert N.llama_ridgefill_get_params(llm._ctx.ctx, ctypes.byref(attached)) == N.LLAMA_RIDGEFILL_TUNABLE[
            "key_rescale"] | N.LLAMA_RIDGEFILL_TUNABLE["tail"] | N.LLAMA_RIDGEFILL_TUNABLE["exact_fraction"] | \
            N.LLAMA_RIDGEFILL_TUNABLE["selector"]
        assert attached.n_key_rescale == 8
        llm.prefill(tokens, 1)
        scales = llm.ridgefill_key_scales()
        assert scales and any(s != 1.0 for row in scales for s in row)
        llm.set_ridgefill(RidgeFill(path, min_prompt=0, key_rescale=0))
        llm.prefill(tokens, 1)
        assert llm.ridgefill_key_scales() == []
    finally:
        llm.close()
    res = benchmark_prefill(tiny_models["llama"], lengths=(200,), maps=path, tail=16, exact_fraction=0.0,
                            min_prompt=0, repeats=1, greedy_tokens=0, n_threads=1)
    assert res.key_rescale == 8
    assert "key rescale c_K = 8" in " ".join(cli("info", path).output.split())  # (the table folds long lines)
    r = cli("eval", tiny_models["llama"], "--maps", path, "--quick", "--docs", 0, "--depths", "0.5",
            "--retrieval-prompts", 1, "--lengths", 256, "--tail", 60, "--threads", 1, "--out", tmp_path / "ev")
    assert r.exit_code == 0, r.output
    assert "key_rescale 8" in " ".join(r.output.split())
    d = json.loads((tmp_path / "ev" / "results.json").read_text())
    assert d["options"]["key_rescale"] == 8 and any("key rescale" in c for c in d["retrieval"]["256"])
    # serve leaves the tuned value to the server, which resolves it from the file as libllama did above;
    # an explicit one is passed
    assert "--ridgefill-key-rescale" not in server_args(tiny_models["llama"], path, "127.0.0.1", 1)
    args = server_args(tiny_models["llama"], RidgeFill(path, key_rescale=0), "127.0.0.1", 1)
    assert args[args.index("--ridgefill-key-rescale") + 1] == "0"


def test_check_key_rescales(cli, tiny_models, fitted):
    assert check_key_rescales([512, 0, 512]) == (0, 512)
    for values, msg in [([], "no key rescales"), ([-1], "key rescale -1 must be >= 0"),
                        ([2.5], "must be an integer")]:
        with pytest.raises(ValueError, match=msg):
            check_key_rescales(values)
    r = cli("tune", tiny_models["llama"], "--maps", fitted[4], "--budget", 0.1, "--key-rescales", "0,x", *CLI_GRID)
    assert r.exit_code != 0 and "--key-rescales" in r.output


# ------------------------------------------------------------------------------------------------
# outputs checked before the work, the map file written last (issue #44, item 3)

def _unwritable_dir() -> str:
    """A directory nothing can be created in, even by root (where ``os.access`` says yes to anything):
    /proc. Skipped on a machine without it."""
    import os

    if not os.path.isdir("/proc/self"):
        pytest.skip("no /proc on this machine: no directory that refuses even root")
    return "/proc/ridgefill-test-out"


def test_every_command_checks_its_outputs_before_the_work(tiny_models, fitted, cli, tmp_path, monkeypatch):
    """`tune --out /proc/x` ran 95 s, rewrote the map file, then died with a FileNotFoundError
    traceback; `fit -o`, `eval --out` and `bench --json` into such a place also failed only after the
    work. Each now fails first, in one line, with the map file untouched: the work functions here
    raise if they are reached at all."""
    import ridgefill_cpp.fitting.fit as fit_mod
    import ridgefill_cpp.quality.bench as bench_mod
    import ridgefill_cpp.quality.evaluate as eval_mod
    import ridgefill_cpp.quality.tune as tune_mod

    def reached(*a, **k):
        raise AssertionError("the work started before the output was checked")

    for mod, name in ((tune_mod, "tune"), (fit_mod, "fit_ridge_maps_for_splits"), (bench_mod, "benchmark_prefill"),
                      (eval_mod, "evaluate")):
        monkeypatch.setattr(mod, name, reached)
    bad = _unwritable_dir()
    maps = _copies(fitted, tmp_path, splits=(4,))
    before = maps[0].read_bytes()
    llama = tiny_models["llama"]
    for args, option in ((("tune", llama, "--maps", maps[0], "--budget", 10, *CLI_GRID, "--out", bad), "--out"),
                         (("tune", llama, "--maps", maps[0], "--budget", 10, *CLI_GRID, "--out", bad + "/deeper"), "--out"),
                         (("fit", llama, "--tokens", 3000, "-o", bad + ".gguf"), None),
                         (("bench", llama, "--maps", maps[0], "--lengths", 256, "--json", bad + ".json"), None),
                         (("eval", llama, "--maps", maps[0], "--lengths", 256, "--out", bad), "--out")):
        r = cli(*args)
        said = " ".join(r.output.split())
        assert r.exit_code == 1 and isinstance(r.exception, SystemExit), (args, r.output, r.exception)
        assert "is not a writable directory" in said and "Traceback" not in r.output, (args, said)
        if option:
            assert said.startswith(f"error: {option} {bad}"), said
    assert maps[0].read_bytes() == before


def test_tune_writes_the_report_then_the_map_file_and_fails_cleanly(tiny_models, fitted, cli, tmp_path, monkeypatch):
    """The map file gets the tuned defaults last, once the report is out; a report that cannot be
    written leaves the map file as it was (one line, no traceback); a map file that cannot be
    written after all leaves a report that says so."""
    import ridgefill_cpp.maps.mapfile as mapfile_mod
    import ridgefill_cpp.quality.tune as tune_mod

    maps = _copies(fitted, tmp_path, splits=(4,))
    before = maps[0].read_bytes()
    out = tmp_path / "out"
    args = ("tune", tiny_models["llama"], "--maps", maps[0], "--budget", 10, *CLI_GRID, "--out", out)

    # the order: tune.md and tune.json exist, naming the map file as written, when the map file is written
    real_write = tune_mod.write_tuned_defaults
    seen = {}

    def write_after_report(path, defaults):
        seen["report"] = json.loads((out / "tune.json").read_text())["written"]
        seen["unchanged"] = maps[0].read_bytes() == before
        return real_write(path, defaults)

    monkeypatch.setattr(tune_mod, "write_tuned_defaults", write_after_report)
    r = cli(*args)
    assert r.exit_code == 0, r.output
    assert seen == {"report": str(maps[0].resolve()), "unchanged": True}
    assert read_tuned_defaults(maps[0])["budget"] == 10.0

    # the report fails: nothing written into the map file, one line
    shutil.copyfile(fitted[4], maps[0])
    monkeypatch.setattr(tune_mod, "write_tuned_defaults", real_write)

    def no_report(*a, **k):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(tune_mod, "write_tune_report", no_report)
    r = cli(*args)
    said = " ".join(r.output.split())
    assert r.exit_code == 1 and isinstance(r.exception, SystemExit) and "Traceback" not in r.output, r.output
    assert f"--out {out}: could not write the report: Permission denied (nothing was written into the map file)" in said
    assert "ΔNLL novel" in said  # the measured table is shown all the same
    assert maps[0].read_bytes() == before

    # the map file fails after the report: the report is written again without the claim
    monkeypatch.undo()

    def no_map(path, defaults):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(mapfile_mod, "write_tuned_defaults", no_map)
    monkeypatch.setattr(tune_mod, "write_tuned_defaults", no_map)
    r = cli(*args)
    said = " ".join(r.output.split())
    assert r.exit_code == 1 and "could not write the tuned defaults into" in said and "(the file is as it was)" in said
    assert "ΔNLL novel" in said
    assert json.loads((out / "tune.json").read_text())["written"] is None
    assert "Not written" in (out / "tune.md").read_text()
    assert maps[0].read_bytes() == before


def test_cli_tune_fit_fits_the_candidate_splits_first_and_uses_them_again(tiny_models, cli, tmp_path):
    """`tune MODEL --fit half`: one command from a model to a tuned map file (issue #47): the maps of
    every split from ⌊L/2⌋ to the default split are fitted beside the model, tuned over, and the chosen
    one gets the tuned defaults; a second run fits nothing; a file in the way is refused before any work."""
    model = tmp_path / "tiny.gguf"
    shutil.copyfile(tiny_models["llama"], model)  # 6 layers: half depth 3, default split 4
    model_sha = _sha(model)
    r = cli("tune", model, "--fit", "half", "--fit-tokens", 3000, "--budget", 10, *CLI_GRID)
    assert r.exit_code == 0, r.output
    paths = [tmp_path / f"tiny.S{s}.ridgefill.gguf" for s in (3, 4)]
    assert [read_map_file(p).meta.split_layer for p in paths] == [3, 4]
    assert read_map_file(paths[0]).meta.calib_n_tokens <= 3000
    assert "fitting maps for S = 3, 4" in r.output and "chosen:" in r.output
    # after its first windows the fit says what the fit and the tune after it will take (issue #54)
    said = " ".join(r.output.split())
    assert re.search(r"estimate: the fit takes about \d+ s \(capture of 2,\d{3} tokens at [\d,]+ tokens/s: \d+ s; solve "
                     r"of 2 splits: \d+ s\), then the tune over \d+ settings \([\d,]+ prompt tokens at the capture's "
                     r"speed\): about .+ in all; peak memory about [\d.]+ GiB", said), said
    assert sum(read_tuned_defaults(p) is not None for p in paths) == 1 and _sha(model) == model_sha

    before = [p.read_bytes() for p in paths]
    r = cli("tune", model, "--fit", "3,4", "--budget", 10, *CLI_GRID, "--dry-run")
    assert r.exit_code == 0, r.output
    assert "fitting maps" not in r.output and r.output.count("--fit: using") == 2
    assert [p.read_bytes() for p in paths] == before

    (tmp_path / "tiny.S2.ridgefill.gguf").write_bytes(b"not a map file")
    r = cli("tune", model, "--fit", "2", "--budget", 10, *CLI_GRID)
    assert r.exit_code == 1 and "cannot be used" in r.output and "move it away" in r.output
    r = cli("tune", model, "--fit", "3,3", "--budget", 10, *CLI_GRID)
    assert r.exit_code == 1 and "distinct" in r.output
    r = cli("tune", model, "--budget", 10, *CLI_GRID)
    assert r.exit_code == 1 and "--maps" in r.output and "--fit" in r.output


def test_cli_tune_fit_dry_run_fits_and_writes_no_map_file(tiny_models, fitted, cli, tmp_path):
    """`tune --fit ... --dry-run` fitted the missing map files beside the model (issue #56): a dry run
    writes no map file; it says which it would fit and tunes over the ones there (if any)."""
    model = tmp_path / "tiny.gguf"
    shutil.copyfile(tiny_models["llama"], model)
    r = cli("tune", model, "--fit", "3,4", "--budget", 10, *CLI_GRID, "--dry-run")
    said = " ".join(r.output.split())
    assert r.exit_code == 0, r.output
    assert (f"--fit: dry run: would fit maps for S = 3, 4 (one capture pass) into {tmp_path / 'tiny.S3.ridgefill.gguf'}, "
            f"{tmp_path / 'tiny.S4.ridgefill.gguf'}: a dry run fits none and writes no map file") in said, said
    assert "dry run: no map file to tune over until they are fitted" in said and "fitting maps" not in said
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny.gguf"]

    # S = 4 there: tuned over (not modified), S = 3 only said
    (s4,) = _copies(fitted, tmp_path, splits=(4,))
    before = s4.read_bytes()
    r = cli("tune", model, "--fit", "3,4", "--budget", 10, *CLI_GRID, "--dry-run")
    said = " ".join(r.output.split())
    assert r.exit_code == 0, r.output
    assert f"--fit: using {s4}" in said and "would fit maps for S = 3 (one capture pass)" in said, said
    assert "it tunes over the other map files only" in said and f"dry run: the tuned defaults would go into {s4}; it was not modified" in said
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny.S4.ridgefill.gguf", "tiny.gguf"]
    assert s4.read_bytes() == before


def test_cli_tune_fit_checks_its_splits_before_any_output_or_work(tiny_models, fitted, cli, tmp_path):
    """`tune --fit 0` said "fitting maps for S = 0" and showed a progress bar before fit refused it
    (issue #56): the splits are checked first, as fit checks them (1..L-2: maps for S+1..L-1)."""
    model = tmp_path / "tiny.gguf"
    shutil.copyfile(tiny_models["llama"], model)  # 6 layers
    _copies(fitted, tmp_path, splits=(4,))  # one split there: not even "using" is said before the error
    for spec, why in (("0", "split 0 outside 1..5 (the model has 6 layers)"),
                      ("4,9", "split 9 outside 1..5 (the model has 6 layers)"),
                      ("4,5", "split 5 = L-1 leaves no layer to map")):
        r = cli("tune", model, "--fit", spec, "--budget", 10, *CLI_GRID)
        said = " ".join(r.output.split())
        assert r.exit_code == 1 and said.startswith(f"error: --fit: {why}"), (spec, r.output)
        assert "fitting" not in said and "using" not in said and "tuning" not in said, (spec, r.output)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny.S4.ridgefill.gguf", "tiny.gguf"]


def test_cli_tune_warns_of_a_speedup_above_its_ceiling(tiny_models, fitted, cli, tmp_path, monkeypatch):
    """A setting's speedup above its ceiling 1/r is noise (issue #53): tune says so below its table, in
    tune.md and tune.json, and with --json on stderr beside the JSON. The timing source is faked:
    exact prefill 2 s, f = 0 0.5 s (4x against a ceiling of 1.48x), f = 0.5 1.9 s (1.05x, under 1.19x)."""
    import ridgefill_cpp.quality.tune as tune_mod
    from ridgefill_cpp.cli.app import out as console

    real = tune_mod.timed_prefill

    def fake(llm, rf, tokens, n_logits):
        logits, _ = real(llm, rf, tokens, n_logits)
        return logits, 2.0 if rf is None else 0.5 if rf.exact_fraction == 0 else 1.9

    monkeypatch.setattr(tune_mod, "timed_prefill", fake)
    monkeypatch.setattr(console, "width", 250)
    (path,) = _copies(fitted, tmp_path, splits=(4,))
    grid = ("--tails", 8, "--fractions", "0,0.5", "--length", 256, "--docs", 2, "--threads", 1, "--retrieval-prompts", 0)
    r = cli("tune", tiny_models["llama"], "--maps", path, "--budget", 10, *grid, "--dry-run", "--out", tmp_path / "out")
    assert r.exit_code == 0, r.output
    d = json.loads((tmp_path / "out" / "tune.json").read_text())
    assert [p["speedup"] for p in d["points"]] == [4.0, pytest.approx(2 / 1.9)]
    (w,) = d["timing_warnings"]
    assert (w["variant"], w["kind"], w["n_prompt"]) == ("S=4 T=8 f=0 w=16", "above ceiling", 256)
    assert w["ceiling"] == pytest.approx(d["points"][0]["ceiling"]) and 1.0 < w["ceiling"] < 1.5
    message = (f"256 tokens, S=4 T=8 f=0 w=16: the speedup 4.00x is above its ceiling {w['ceiling']:.2f}x, which no "
               "prefill reaches: the timing is noise, not a speedup. Run again on a quieter machine (nothing else running).")
    assert w["message"] == message and f"warning: {message}" in " ".join(r.output.split())
    assert f"> **Warning:** {message}" in (tmp_path / "out" / "tune.md").read_text()
    r = cli("tune", tiny_models["llama"], "--maps", path, "--budget", 10, *grid, "--dry-run", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["timing_warnings"][0]["message"] == message
    assert f"warning: {message}" in " ".join(r.stderr.split())
