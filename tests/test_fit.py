"""Ridge fitting: closed-form correctness, streaming statistics, λ selection, end-to-end fits."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
import torch

from ridgefill_cpp.fitting import corpus
from ridgefill_cpp.fitting.fit import (
    FitError,
    FitOptions,
    RidgeStatistics,
    evaluate_maps,
    fit_ridge_maps,
    select_and_solve,
    solve_ridge,
    window_lengths,
    window_plan,
)
from ridgefill_cpp.maps.mapfile import read_map_file, write_map_file


def _synthetic(n=600, d=12, seed=0, noise=0.01):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g, dtype=torch.float64) * torch.linspace(0.2, 3.0, d, dtype=torch.float64)
    a_true = torch.randn(d, d, generator=g, dtype=torch.float64)
    b_true = torch.randn(d, generator=g, dtype=torch.float64)
    y = x @ a_true.T + b_true + noise * torch.randn(n, d, generator=g, dtype=torch.float64)
    return x, y, a_true, b_true


def test_known_linear_relation_is_recovered():
    x, y, a_true, b_true = _synthetic(noise=1e-3)
    stats = RidgeStatistics(x.shape[1], [7])
    stats.update(x, {7: y})
    a, b = solve_ridge(stats, 7, lam=1e-9)
    assert torch.allclose(a, a_true, atol=2e-3)
    assert torch.allclose(b, b_true, atol=2e-3)


def test_streaming_equals_batch_accumulation():
    x, y, _, _ = _synthetic(n=500)
    one = RidgeStatistics(x.shape[1], [3])
    one.update(x, {3: y})
    many = RidgeStatistics(x.shape[1], [3])
    for lo in range(0, 500, 37):
        many.update(x[lo:lo + 37], {3: y[lo:lo + 37]})
    assert many.n == one.n == 500
    assert torch.allclose(many.sxx, one.sxx, rtol=1e-12)
    assert torch.allclose(many.sxy[3], one.sxy[3], rtol=1e-12)
    # and against the definition
    xb = torch.cat([x, torch.ones(500, 1, dtype=torch.float64)], 1)
    gram = xb.T @ xb
    assert torch.allclose(one.sxx, gram[:-1, :-1]) and torch.allclose(one.sx, gram[-1, :-1])


def test_selected_maps_satisfy_the_ridge_normal_equations():
    x, y, _, _ = _synthetic(n=800, noise=0.5)
    train, held = slice(0, 600), slice(600, 800)
    stats = RidgeStatistics(x.shape[1], [1])
    stats.update(x[train], {1: y[train]})
    grid = [1e-6, 1e-3, 1e-1, 1.0, 10.0]
    (a, b, lam, mses), = select_and_solve(stats, x[held], {1: y[held]}, grid).values()
    mx, cxx = stats.centred()
    my, cxy = stats.cross(1)
    # (Cxx + λI) Aᵀ = Cxy and b = μy - A μx: the closed form, for the λ that was chosen
    lhs = (cxx + lam * torch.eye(x.shape[1], dtype=torch.float64)) @ a.T
    assert torch.allclose(lhs, cxy, atol=1e-8)
    assert torch.allclose(b, my - a @ mx)
    # the O(d²) held-out error per λ equals the error computed row by row
    scale = float(torch.linalg.eigvalsh(cxx).clamp_min(0).mean())
    for alpha, mse in zip(grid, mses):
        a2, b2 = solve_ridge(stats, 1, alpha * scale)
        direct = float(((y[held] - (x[held] @ a2.T + b2)) ** 2).sum()) / 200
        assert mse == pytest.approx(direct, rel=1e-6)
    assert lam == pytest.approx(grid[int(np.argmin(mses))] * scale)


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def tiny_fit(tiny_models):
    """A fit of the tiny llama model on 6000 calibration tokens (seconds)."""
    path = tiny_models["llama"]
    before = _sha(path)
    res = fit_ridge_maps(path, corpus.default_documents("calibration"),
                         FitOptions(n_tokens=6000, ctx=128, split=3), source="test")
    assert _sha(path) == before  # the model file is never modified
    return path, res


def test_fit_on_a_tiny_model(tiny_fit):
    path, res = tiny_fit
    m = res.maps.meta
    assert (m.architecture, m.split_layer, m.n_layer, m.n_embd, m.layers) == ("llama", 3, 6, 64, [4, 5])
    assert m.calib_ctx == 128 and m.calib_skip_rows == 4 and m.objective == "normalized"
    assert m.calib_n_rows == sum(1 for w in range(res.n_windows) if (w + 1) % 10) * (128 - 4)
    assert all(lam > 0 for lam in m.lambdas)
    # on held-out rows the maps beat identity fill at every layer
    assert all(r < i for r, i in zip(m.rel_err_median, m.identity_rel_err_median)), (m.rel_err_median, m.identity_rel_err_median)
    assert all(0 < r2 <= 1 for r2 in m.r2)


def test_maps_beat_identity_on_evaluation_text(tiny_fit):
    path, res = tiny_fit
    ev = evaluate_maps(path, res.maps, corpus.default_documents("evaluation"), n_tokens=3000)
    assert ev["layers"] == [4, 5]
    assert all(r < i for r, i in zip(ev["ridge"], ev["identity"])), ev


@pytest.mark.parametrize("arch", ["qwen3", "gemma3", "qwen35"])
def test_fit_every_architecture(tiny_models, arch, tmp_path):
    res = fit_ridge_maps(tiny_models[arch], corpus.default_documents("calibration"),
                         FitOptions(n_tokens=3000, ctx=128, objective="raw"))
    out = write_map_file(tmp_path / "m.gguf", res.maps, dtype="f32")
    back = read_map_file(out)
    assert back.meta.architecture == arch and back.meta.objective == "raw"
    for il in back.meta.layers:
        assert np.array_equal(back.a[il], res.maps.a[il]) and np.array_equal(back.b[il], res.maps.b[il])


def test_window_plan_one_length_is_the_plain_cut():
    plan = window_plan(1000, [128], 1, 3)
    assert [(w.start, w.n_tokens) for w in plan] == [(127 * i, 127) for i in range(7)]
    assert [i for i, w in enumerate(plan) if w.heldout] == [2, 5]
    assert [w.heldout for w in window_plan(300, [128], 1, 10)] == [False, True]  # fewer: the last one


def test_window_plan_mixed_lengths():
    plan = window_plan(30_000, window_lengths((4096, 512)), 1, 10)
    short, long = [w for w in plan if w.n_tokens == 511], [w for w in plan if w.n_tokens == 4095]
    assert len(short) == 29 and len(long) == 3 and len(plan) == 32  # an equal share of 15,000 tokens each
    # consecutive, non-overlapping slices of the tokens, within the budget
    assert [w.start for w in plan] == list(np.cumsum([0] + [w.n_tokens for w in plan[:-1]]))
    assert plan[-1].start + plan[-1].n_tokens <= 30_000
    # each length spread over the text, and held out on its own: every 10th short window, the last long one
    assert [i for i, w in enumerate(plan) if w.n_tokens == 4095] == [5, 16, 26]
    assert [w.heldout for w in long] == [False, False, True]
    assert [i for i, w in enumerate(short) if w.heldout] == [9, 19]
    assert [w.n_tokens for w in window_plan(5000, [512, 4096], 1, 10)] == [511] * 4  # no room for a long one
    with pytest.raises(FitError, match="distinct"):
        window_lengths((512, 512))


def test_mixed_length_windows_on_a_tiny_model(tiny_models, tiny_fit, tmp_path, cli):
    path, single = tiny_fit
    res = fit_ridge_maps(path, corpus.default_documents("calibration"),
                         FitOptions(n_tokens=6000, ctx=(64, 256), split=3), source="test")
    m = res.maps.meta
    plan = window_plan(6000, (64, 256), 1, 10)  # the tiny model adds BOS
    assert res.n_windows == len(plan) == 47 + 11
    assert (m.calib_ctx, m.calib_ctx_lengths, m.calib_windows) == (256, [64, 256], "64+256")
    assert m.calib_n_tokens == sum(w.n_tokens for w in plan)
    assert m.calib_n_rows == sum(w.n_tokens + 1 - 4 for w in plan if not w.heldout)
    assert all(r < i for r, i in zip(m.rel_err_median, m.identity_rel_err_median))
    assert not any(np.array_equal(res.maps.a[il], single.maps.a[il]) for il in m.layers)
    back = read_map_file(write_map_file(tmp_path / "mixed.gguf", res.maps, dtype="f32")).meta
    assert (back.calib_ctx, back.calib_ctx_lengths) == (256, [64, 256])
    assert read_map_file(write_map_file(tmp_path / "one.gguf", single.maps, dtype="f32")).meta.calib_ctx_lengths == []
    # the CLI: --ctx takes several lengths, info shows them; bad lists are refused before any work
    out = tmp_path / "cli.gguf"
    r = cli("fit", path, "--tokens", 3000, "--ctx", "64,128", "--split", 3, "-o", out)
    assert r.exit_code == 0, r.output
    assert "windows of 64+128" in " ".join(r.output.split()) and "64+128" in cli("info", out).output
    for bad, msg in (("64,64", "distinct"), ("4,128", "at least 8"), ("64,x", "comma-separated integers")):
        r = cli("fit", path, "--ctx", bad, "-o", tmp_path / "bad.gguf")
        assert r.exit_code != 0 and msg in " ".join(r.output.split()), r.output
    assert not (tmp_path / "bad.gguf").exists()
    with pytest.raises(FitError, match=r"too little calibration text: \d+ tokens make \d+ window\(s\) of 64, 0 window"):
        fit_ridge_maps(path, corpus.default_documents("calibration"), FitOptions(n_tokens=1500, ctx=(64, 1024)))


def test_fit_never_replaces_a_model_with_its_maps(cli, tiny_models, tmp_path):
    """``fit -o OTHER_MODEL.gguf --force`` refused before any work, as ``digest -o``: --force replaces an
    earlier output, never a GGUF that is not a RidgeFill map file."""
    import shutil

    other = tmp_path / "other.gguf"
    shutil.copy(tiny_models["qwen3"], other)
    kept = other.read_bytes()
    r = cli("fit", tiny_models["llama"], "--tokens", 3000, "--ctx", 64, "--split", 3, "-o", other, "--force")
    assert r.exit_code == 1, r.output
    assert "is a GGUF model" in " ".join(r.output.split()) and other.read_bytes() == kept


def test_too_little_text_says_how_much_is_needed(tiny_models, tmp_path):
    with pytest.raises(FitError, match=r"too little calibration text: \d+ tokens .* at least 65 training rows"):
        fit_ridge_maps(tiny_models["llama"], [corpus.Document("x", "text", "just a few words")], FitOptions(ctx=64))


@pytest.mark.parametrize("split", [0, 6, 7, 5])
def test_split_out_of_range(tiny_models, split):
    with pytest.raises(FitError, match="split"):
        fit_ridge_maps(tiny_models["llama"], corpus.default_documents("calibration"), FitOptions(split=split))


def test_unsupported_architecture(unsupported_model):
    with pytest.raises(FitError, match="'gpt2' is not supported .*llama, qwen3, gemma3, qwen35"):
        fit_ridge_maps(unsupported_model, [], FitOptions())


def test_several_splits_from_one_capture_pass_equal_separate_fits(tiny_models):
    from ridgefill_cpp.fitting.fit import fit_ridge_maps_for_splits

    path = tiny_models["qwen3"]
    opt = FitOptions(n_tokens=4000, ctx=128, n_threads=1)
    together = fit_ridge_maps_for_splits(path, corpus.default_documents("calibration"), [2, 4], opt)
    assert [r.maps.meta.split_layer for r in together] == [2, 4]
    for res in together:
        alone = fit_ridge_maps(path, corpus.default_documents("calibration"),
                               FitOptions(split=res.maps.meta.split_layer, n_tokens=4000, ctx=128, n_threads=1))
        assert res.maps.meta.layers == alone.maps.meta.layers
        assert res.maps.meta.lambdas == alone.maps.meta.lambdas
        for il in alone.maps.meta.layers:
            np.testing.assert_array_equal(res.maps.a[il], alone.maps.a[il])
            np.testing.assert_array_equal(res.maps.b[il], alone.maps.b[il])
    with pytest.raises(FitError, match="distinct"):
        fit_ridge_maps_for_splits(path, [], [3, 3], opt)


def test_fit_ctx_beyond_the_training_context_and_a_context_llama_cpp_cannot_create(cli, tiny_models, tmp_path,
                                                                                    monkeypatch):
    from ridgefill_cpp.fitting import capture

    res = cli("fit", tiny_models["llama"], "--ctx", 1_000_000, "-o", tmp_path / "o.gguf")
    assert res.exit_code == 1, res.output
    assert "ctx 1000000 is longer than the model's training context (2048 tokens)" in " ".join(res.output.split())
    assert "Traceback" not in res.output and not (tmp_path / "o.gguf").exists()

    def no_context(*a, **k):
        raise ValueError("Failed to create llama_context")  # what llama-cpp-python says when allocation fails

    monkeypatch.setattr(capture, "open_model", no_context)
    with pytest.raises(FitError, match="could not create a context of 2048 rows .* use a smaller ctx"):
        fit_ridge_maps(tiny_models["llama"], corpus.default_documents("calibration"), FitOptions(ctx=2048))


@pytest.mark.parametrize("command", ["fit", "bench", "eval", "tune", "demo"])
def test_every_threads_option_is_bounded(cli, tiny_models, tmp_path, command):
    """llama.cpp crashes with more threads than GGML_MAX_N_THREADS (512): every --threads says so first."""
    args = {"fit": (tiny_models["llama"], "-o", tmp_path / "o.gguf"), "bench": (tiny_models["llama"],),
            "eval": (tiny_models["llama"], "--maps", tmp_path / "m.gguf"),
            "tune": (tiny_models["llama"], "--maps", tmp_path / "m.gguf", "--budget", 0.1),
            "demo": ("--model", tiny_models["llama"])}[command]
    for bad in (100_000, 513, 0):
        res = cli(command, *args, "--threads", bad)
        assert res.exit_code == 2, (command, bad, res.output)
        assert "--threads" in res.output and "Traceback" not in res.output


def test_llama_refuses_more_threads_than_llama_cpp_takes(tiny_models):
    """The Python API too (in a subprocess: the crash it prevents would take pytest with it)."""
    import os
    import subprocess
    import sys

    import ridgefill_cpp

    code = ("import ridgefill_cpp\n"
            f"try:\n    ridgefill_cpp.Llama({str(tiny_models['llama'])!r}, n_threads=100000, verbose=False)\n"
            "except ValueError as e:\n    print(e)\n")
    env = dict(os.environ, PYTHONPATH=str(Path(ridgefill_cpp.__file__).resolve().parent.parent))
    proc = subprocess.run([sys.executable, "-c", code], env=env, timeout=120, capture_output=True, text=True)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    assert "n_threads 100000 must be <= 512" in proc.stdout, proc.stdout
