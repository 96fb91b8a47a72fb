"""``ridgefill-gguf eval`` end to end on a tiny model, and its guarantees (exact vs exact)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ridgefill_cpp.fitting import corpus
from ridgefill_cpp.quality.evaluate import EvalOptions, build_documents, default_texts, evaluate, licence_documents
from ridgefill_cpp.fitting.fit import FitOptions, fit_ridge_maps
from ridgefill_cpp.maps.mapfile import write_map_file
from ridgefill_cpp.quality.report import ci_text, write_report


@pytest.fixture(scope="module")
def tiny_maps(tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("eval-maps")
    out = []
    for split in (4, 3):
        fit = fit_ridge_maps(tiny_models["llama"], corpus.default_documents("calibration"),
                             FitOptions(n_tokens=3000, ctx=128, split=split, n_threads=1))
        out.append(write_map_file(root / f"tiny.S{split}.gguf", fit.maps))
    return out


def test_texts_are_disjoint_from_calibration_and_documented():
    texts = default_texts()
    assert {"documentation", "code"} <= set(texts)
    names = {n for docs in texts.values() for n, _ in docs}
    calib = {d.name for d in corpus.default_documents("calibration")}
    assert not names & calib
    if licence_documents():  # Debian machines
        assert "prose" in texts and all(n.startswith("licence:") for n, _ in texts["prose"])


def test_documents_have_the_length_and_rotate_kinds():
    texts = {"a": [("a1", "x " * 15), ("a2", "y " * 15)], "b": [("b1", "z " * 100)]}
    docs = build_documents(lambda t: [ord(c) for c in t], [1], texts, 50, 3)
    assert [d.kind for d in docs] == ["a", "b"] and all(len(d.tokens) == 51 for d in docs)
    assert docs[0].name == "a1 (+1)" and docs[0].tokens[0] == 1
    with pytest.raises(ValueError, match="no 1001-token document"):
        build_documents(lambda t: [1] * len(t), [], {"a": [("a", "short")]}, 1000, 2)


def test_eval_quick_writes_a_well_formed_report(tiny_models, tiny_maps, cli, tmp_path):
    out = tmp_path / "report"
    r = cli("eval", tiny_models["llama"], "--maps", tiny_maps[0], "--maps", tiny_maps[1], "--quick", "--docs", 3,
            "--threads", 1, "--key-rescale", 16, "--selectors", "probe,protected:digits+rare", "--out", out)
    assert r.exit_code == 0, r.output
    d = json.loads((out / "results.json").read_text())
    assert d["splits"] == [4, 3] and d["key_cut"]["1024"]["k"] >= 64
    s = d["summary"]["1024"]
    levers = {"ridge + key rescale", "ridge, probe selector", "ridge, protected:digits+rare selector"}
    assert set(s) == {"ridge", "identity", "ridge S=3", "ridge, exact K", "ridge, exact V"} | levers
    # each lever against plain ridge, paired by document: the difference of the two token-weighted means
    assert set(d["paired"]["1024"]) == levers
    for v in levers:
        ci = d["paired"]["1024"][v]["novel"]
        assert ci["low"] <= ci["estimate"] <= ci["high"]
        assert ci["estimate"] == pytest.approx(s[v]["novel"]["delta"]["estimate"] - s["ridge"]["novel"]["delta"]["estimate"],
                                               abs=1e-12)
    assert d["plans"]["1024"]["ridge, probe selector"]["ceiling"] < d["plans"]["1024"]["ridge"]["ceiling"]
    for v in s.values():
        for m in ("all", "novel"):
            ci = v[m]["delta"]
            assert ci["low"] <= ci["estimate"] <= ci["high"] and ci["n"] == 3
    assert len(d["docs"]["1024"]["exact"]) == 3
    assert set(d["retrieval"]["1024"]) == {"exact", "ridge, planted row filled", "ridge, attention selector",
                                           "identity, planted row filled", "identity, attention selector",
                                           "ridge + key rescale, attention selector",
                                           "ridge, probe selector", "ridge, protected:digits+rare selector"}
    md = (out / "report.md").read_text()
    assert "## 1024-token prompts" in md and "Splice test" in md and "Filled-region retrieval" in md
    assert "**Levers**" in md and "| ridge, probe selector |" in md
    assert (out / "levers_1024.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and "](levers_1024.png)" in md
    assert "PSF-2.0" in md and "K = " in md
    for png in ("delta_nll_1024.png", "split_sweep.png", "retrieval_1024.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"]({png})" in md
    assert not list(out.glob(".*.tmp"))


def test_exact_against_exact_is_zero(tiny_models, tiny_maps, tmp_path):
    """Fill variants that run stock prefill (prompts below min_prompt): ΔNLL is exactly 0 on every
    metric and document, and retrieval answers equal exact's (three codes a prompt here)."""
    res = evaluate(tiny_models["llama"], [tiny_maps[0]],
                   EvalOptions.quick(min_prompt=10**6, n_docs=3, splice=False, n_threads=1, key_rescale=8,
                                     selectors=("probe", "protected", "attention@8"), queries=(16,), codes=3,
                                     depths=(0.2, 0.5, 0.9), names_per_depth=2))
    for v, row in res.paired["1024"].items():
        assert row["novel"]["estimate"] == row["novel"]["low"] == row["novel"]["high"] == 0.0, v
    for v, row in res.summary["1024"].items():
        for m in ("all", "novel"):
            assert row[m]["delta"]["estimate"] == 0.0 and row[m]["delta"]["low"] == row[m]["delta"]["high"] == 0.0, (v, m)
    for v, recs in res.docs["1024"].items():
        if v != "exact":
            assert all(r["all"][0] == 0.0 for r in recs)
    preds = {c: v["predictions"] for c, v in res.retrieval["1024"].items()}
    assert all(p == preds["exact"] for p in preds.values())
    wrong = {c: v["distractor_answers"] for c, v in res.retrieval["1024"].items()}
    assert all(v["codes"] == 3 for v in res.retrieval["1024"].values()) and len(set(wrong.values())) == 1
    n_exact = sum(res.retrieval["1024"]["exact"]["correct"])
    assert all(v["kept"] == [n_exact, n_exact] and len(v["answers"]) == 6 for v in res.retrieval["1024"].values())
    assert list(res.retrieval["1024"]["exact"]["by_depth"]) == ["0.2", "0.5", "0.9"]
    assert "ridge, attention@8 selector" in res.retrieval["1024"] and "ridge, 16 query rows" in res.retrieval["1024"]
    assert "ridge, 16 query rows" in res.paired["1024"]
    write_report(res, tmp_path / "r", 1.0)
    md = (tmp_path / "r" / "report.md").read_text()
    assert "3 codes of different names per prompt" in md and "| distractor answers |" in md and "| accuracy | kept |" in md


def test_plant_facts():
    """The facts go in order of depth at their share of the region before the tail, the question
    ends the prompt, and the distractors of a prompt sit before its fact, apart, inside the region."""
    from ridgefill_cpp.quality.evaluate import distractor_depths, plant_facts

    bos, filler, q = [1], list(range(100, 1100)), [7, 7, 7]
    facts = [(0.5, [-1, -1]), (0.1, [-2]), (0.9, [-3, -3, -3])]
    toks = plant_facts(bos, filler, facts, q, n=200, tail=20)
    assert len(toks) == 200 and toks[0] == 1 and toks[-3:] == q
    region = 200 - 20 - 1 - 6
    where = {f: toks.index(f) for f in (-1, -2, -3)}
    assert where[-2] < where[-1] < where[-3] < 200 - 20
    assert where[-2] == 1 + round(0.1 * region) and where[-1] == 1 + round(0.5 * region) + 1
    assert [t for t in toks if t >= 100] == filler[:200 - 1 - 6 - 3]  # the filler, in order, once
    one = plant_facts(bos, filler, [(0.3, [-1])], q, n=200, tail=20)
    assert one == bos + filler[:round(0.3 * 178)] + [-1] + filler[round(0.3 * 178):195] + q
    for depth in (0.1, 0.5, 0.9):
        ds = distractor_depths(depth, 4)
        assert len(ds) == 3 and ds[0] == 0.02 and all(a < b for a, b in zip(ds, ds[1:] + [depth]))
    assert distractor_depths(0.5, 1) == [] and distractor_depths(0.01, 2) == [0.01]
    with pytest.raises(ValueError, match="does not fit the tail"):
        plant_facts(bos, filler, facts, [7] * 20, n=200, tail=20)
    for bad in (0, 13, 2.0):
        with pytest.raises(ValueError, match="facts per retrieval prompt"):
            EvalOptions(codes=bad).check()
    for kw, msg in (({"depths": ()}, "retrieval depths"), ({"depths": (0.5, 1.5)}, "retrieval depths"),
                    ({"names_per_depth": 0}, "prompts per depth")):
        with pytest.raises(ValueError, match=msg):
            EvalOptions(**kw).check()


def test_eval_bad_input(tiny_models, tiny_maps, cli, tmp_path):
    r = cli("eval", tiny_models["qwen3"], "--maps", tiny_maps[0], "--quick", "--out", tmp_path / "x")
    assert r.exit_code == 1 and "architecture" in r.output
    r = cli("eval", tiny_models["llama"], "--maps", tiny_maps[0], "--lengths", "100", "--out", tmp_path / "x")
    assert r.exit_code == 1 and "at least 4 x the tail" in r.output
    r = cli("eval", tiny_models["llama"], "--maps", tiny_maps[0], "--lengths", "4000", "--out", tmp_path / "x")
    assert r.exit_code == 1 and "longer than the model's context" in r.output
    r = cli("eval", tiny_models["llama"], "--maps", tiny_maps[0], "--maps", tiny_maps[0], "--out", tmp_path / "x")
    assert r.exit_code == 1 and "two map files for the same split" in r.output
    r = cli("eval", tiny_models["llama"], "--maps", tiny_maps[0], "--selectors", "probe,guess", "--out", tmp_path / "x")
    assert r.exit_code == 1 and "selector 'guess'" in r.output
    r = cli("eval", tiny_models["llama"], "--maps", tiny_maps[0], "--selector", "protected:vowels", "--out", tmp_path / "x")
    assert r.exit_code == 1 and "protected token classes" in r.output
    empty = tmp_path / "empty"
    empty.mkdir()
    r = cli("eval", tiny_models["llama"], "--maps", tiny_maps[0], "--text", empty, "--out", tmp_path / "x")
    assert r.exit_code == 1 and "text found" in r.output
    assert not (tmp_path / "x").exists()


def test_hybrid_splice_test_replaces_the_recurrent_state(tiny_models, tmp_path):
    """qwen35: the splice test adds "ridge, exact state" (every late GDN layer's tail starts from the
    exact prefix's state). It removes most of the fill's error on the tiny hybrid: the documents'
    mean |ΔNLL| drops below the plain ridge fill's."""
    model = tiny_models["qwen35"]
    fit = fit_ridge_maps(model, corpus.default_documents("calibration"), FitOptions(n_tokens=3000, ctx=128, split=3, n_threads=1))
    maps = write_map_file(tmp_path / "qwen35.S3.gguf", fit.maps)
    res = evaluate(model, [maps], EvalOptions.quick(n_docs=3, n_threads=1, lengths=[512]))
    docs = res.docs["512"]
    assert len(docs["ridge, exact state"]) == len(docs["ridge"]) == 3
    assert set(res.splice["512"]) == {"K", "V", "state"}
    ridge = np.mean([abs(r["all"][0]) for r in docs["ridge"]])
    spliced = np.mean([abs(r["all"][0]) for r in docs["ridge, exact state"]])
    assert spliced < ridge


def test_retrieval_only(tiny_models, tiny_maps, cli, tmp_path):
    """--docs 0: the retrieval prompts alone (no documents, no ΔNLL), in the report and on the console."""
    out = tmp_path / "r"
    r = cli("eval", tiny_models["llama"], "--maps", tiny_maps[0], "--quick", "--docs", "0", "--depths", "0.3,0.8",
            "--retrieval-prompts", "1", "--selectors", "attention@4", "--threads", "1", "--out", out)
    assert r.exit_code == 0, r.output
    res = json.loads((out / "results.json").read_text())
    assert res["summary"] == {} and res["docs"] == {}
    r1 = res["retrieval"]["1024"]
    assert list(r1) == ["exact", "ridge, planted row filled", "ridge, attention selector", "identity, planted row filled",
                        "identity, attention selector", "ridge, attention@4 selector"]
    assert all(len(v["answers"]) == 2 and list(v["by_depth"]) == ["0.3", "0.8"] for v in r1.values())
    md = (out / "report.md").read_text()
    assert "retrieval only (no documents)" in md and "| ridge, attention@4 selector |" in md and "ΔNLL novel |" not in md
    assert "filled-region" in r.output and "attention@4" in r.output  # the console table
    r = cli("eval", tiny_models["llama"], "--maps", tiny_maps[0], "--quick", "--docs", "1", "--out", tmp_path / "x")
    assert r.exit_code == 1 and "0 (retrieval only) or an integer >= 2" in r.output
    for bad, why in (("8,8", "each once"), ("64", "not the default 64"), ("0", "query rows")):
        r = cli("eval", tiny_models["llama"], "--maps", tiny_maps[0], "--quick", "--docs", "0", "--queries", bad,
                "--out", tmp_path / "x")
        assert r.exit_code == 1 and why in r.output, (bad, r.output)


def test_compare_maps(tiny_models, tiny_maps, cli, tmp_path):
    """--compare-maps: other map files for the main split, each a ridge variant named by how its
    calibration differs, paired against the main maps and with a retrieval condition. A byte copy of
    the main file must score exactly like it (paired difference 0, the same answers); maps fitted on
    other windows must not."""
    model = tiny_models["llama"]
    copy = tmp_path / "copy.gguf"
    copy.write_bytes(tiny_maps[0].read_bytes())
    fit = fit_ridge_maps(model, corpus.default_documents("calibration"), FitOptions(n_tokens=3000, ctx=256, split=4, n_threads=1))
    longer = write_map_file(tmp_path / "tiny.ctx256.S4.gguf", fit.maps)
    res = evaluate(model, [tiny_maps[0], tiny_maps[1]],
                   EvalOptions.quick(n_docs=2, splice=False, n_threads=1, lengths=[512], depths=(0.3, 0.7),
                                     names_per_depth=1, selector="attention@4"),
                   compare_maps=[copy, longer])
    same = "ridge (copy.gguf)"
    other = next(v for v in res.compared_maps if v != same)  # 256-row windows hold other rows: tokens differ too
    assert other.startswith("ridge (256-row windows, ") and other.endswith(" tokens)")
    assert res.compared_maps == {same: str(copy), other: str(longer)}
    assert set(res.paired["512"]) == {same, other}
    for m in ("all", "novel"):
        assert res.paired["512"][same][m]["estimate"] == res.paired["512"][same][m]["low"] == 0.0
    assert [r["all"] for r in res.docs["512"][same]] == [r["all"] for r in res.docs["512"]["ridge"]]
    assert [r["all"] for r in res.docs["512"][other]] != [r["all"] for r in res.docs["512"]["ridge"]]
    r = res.retrieval["512"]
    assert r[f"{same}, attention@4 selector"]["predictions"] == r["ridge, attention@4 selector"]["predictions"]
    assert f"{other}, attention@4 selector" in r and "ridge S=3" in res.summary["512"]
    write_report(res, tmp_path / "r", 1.0)
    md = (tmp_path / "r" / "report.md").read_text()
    assert f'`tiny.ctx256.S4.gguf` as "{other}"' in md and f"| {other} |" in md
    # maps for another split, or the main file again: refused, naming the file
    for bad, why in ((tiny_maps[1], "a comparison needs maps for the main split (S = 4)"), (tiny_maps[0], "listed twice")):
        r = cli("eval", model, "--maps", tiny_maps[0], "--compare-maps", bad, "--quick", "--out", tmp_path / "x")
        assert r.exit_code == 1 and why in r.output, r.output
    assert not (tmp_path / "x").exists()


def test_ci_text():
    """A CI as text; with one document there is no interval, and the text says so (not "[+nan, +nan]")."""
    assert ci_text({"estimate": 0.01234, "low": -0.002, "high": 0.03, "n": 4}) == "+0.0123 [-0.0020, +0.0300]"
    assert ci_text({"estimate": 0.01234, "low": -0.002, "high": 0.03, "n": 4}, bound_fmt="{:+.3f}") == "+0.0123 [-0.002, +0.030]"
    assert ci_text({"estimate": 0.5, "low": float("nan"), "high": float("nan"), "n": 1}) == "+0.5000 (1 document: no CI)"
    assert ci_text(None) == "—"


def test_an_empty_text_option_is_named_by_its_use(tiny_models, tiny_maps, cli, tmp_path):
    """Text options with no text in them: eval (and eval --ruler) name the evaluation text, tune the
    held-out text, fit the calibration text; eval --ruler --text spoke of "calibration text" (issue #56)."""
    empty = tmp_path / "empty"
    empty.mkdir()
    model, maps = tiny_models["llama"], tiny_maps[0]
    for args, what in ((("eval", model, "--maps", maps, "--text", empty, "--out", tmp_path / "x"), "evaluation text"),
                       (("eval", model, "--maps", maps, "--ruler", "--lengths", 1024, "--text", empty, "--out",
                         tmp_path / "x"), "evaluation text"),
                       (("tune", model, "--maps", maps, "--budget", 1, "--dry-run", "--text", empty), "held-out text"),
                       (("fit", model, empty, "-o", tmp_path / "m.gguf"), "calibration text")):
        r = cli(*args)
        said = " ".join(r.output.split())
        assert r.exit_code == 1 and said == f"error: no {what} found in {empty} (all empty?)", (args, r.output)
    assert not (tmp_path / "x").exists() and not (tmp_path / "m.gguf").exists()


def test_eval_warns_of_a_speed_above_its_ceiling(tiny_models, tiny_maps, cli, tmp_path, monkeypatch):
    """A speed above the plan's ceiling 1/r is noise (issue #53): eval says so below its table, in
    report.md and in results.json. The timing source is faked (exact prefill 2 s, RidgeFill 0.5 s:
    4x against a ceiling below L/S = 1.5); the documents are timed once each, so their spread is
    never judged."""
    from ridgefill_cpp.cli.app import out as console
    from ridgefill_cpp.quality import evaluate as ev

    real = ev.timed_prefill

    def fake(llm, rf, tokens, n_logits):
        logits, _ = real(llm, rf, tokens, n_logits)
        return logits, 2.0 if rf is None else 0.5

    monkeypatch.setattr(ev, "timed_prefill", fake)
    monkeypatch.setattr(console, "width", 250)
    out = tmp_path / "r"
    r = cli("eval", tiny_models["llama"], "--maps", tiny_maps[0], "--quick", "--lengths", "512", "--docs", 2,
            "--depths", "0.5", "--retrieval-prompts", 1, "--threads", 1, "--out", out)
    assert r.exit_code == 0, r.output
    d = json.loads((out / "results.json").read_text())
    ceiling = d["plans"]["512"]["ridge"]["ceiling"]
    assert 1.0 < ceiling < 1.5
    warned = {w["variant"]: w for w in d["timing_warnings"]}
    # every fill variant, the splice variants with plain ridge's ceiling; never exact, never a spread
    assert set(warned) == {"ridge", "identity", "ridge, exact K", "ridge, exact V"}
    assert all(w["kind"] == "above ceiling" and w["speedup"] == 4.0 and w["n_prompt"] == 512 for w in warned.values())
    assert warned["ridge, exact K"]["ceiling"] == ceiling
    message = (f"512 tokens, ridge: the speedup 4.00x is above its ceiling {ceiling:.2f}x, which no prefill reaches: "
               "the timing is noise, not a speedup. Run again on a quieter machine (nothing else running).")
    assert warned["ridge"]["message"] == message
    assert f"warning: {message}" in " ".join(r.output.split())
    md = (out / "report.md").read_text()
    assert f"> **Warning:** {message}" in md and "is noise (another load on the machine) and is flagged" in md
