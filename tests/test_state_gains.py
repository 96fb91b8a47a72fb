"""Terminal-state gains (docs/design.md §4 item 4; qwen35): map-file tensors, the llama.cpp-measured
least-squares fit against its definition and the float64 oracle, and ``fit --state-gains``."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from conftest import evaluation_tokens
from ridgefill_cpp.fitting import corpus
from ridgefill_cpp.maps import mapfile
from ridgefill_cpp.fitting.fit import FitError, FitOptions, fit_ridge_maps
from ridgefill_cpp.maps.mapfile import MapFileError, MapFileMeta, RidgeMaps, read_map_file, write_map_file

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SPLIT = 3  # tiny qwen35: layers 0, 1, 3, 4 recurrent; mapped layers 4 (recurrent) and 5 (attention)
TAIL = 16
FRACTION = 0.10
CTX = 128


def _maps(gains=None, n_embd=8) -> RidgeMaps:
    rng = np.random.default_rng(0)
    layers = [4, 5]
    meta = MapFileMeta(
        architecture="qwen35", split_layer=SPLIT, n_layer=6, n_embd=n_embd, layers=layers, lambdas=[0.1, 0.2],
        calib_n_tokens=1000, calib_n_rows=900, calib_source="unit test", calib_ctx=128, calib_skip_rows=4,
        heldout_n_rows=100, r2=[0.9] * 2, rel_err_median=[0.2] * 2, identity_rel_err_median=[0.5] * 2,
        fingerprint="sha256:x", model_name="m", tool_version="t",
    )
    return RidgeMaps(meta, {il: rng.standard_normal((n_embd, n_embd)).astype(np.float32) for il in layers},
                     {il: rng.standard_normal(n_embd).astype(np.float32) for il in layers},
                     {} if gains is None else gains)


# -- the map file ---------------------------------------------------------------------------------


def test_gains_round_trip_and_count_as_map_bytes(tmp_path):
    import gguf

    g = np.array([0.7, 0.9, 1.1, 1.3], dtype=np.float32)
    p = write_map_file(tmp_path / "g.gguf", _maps({4: g}), dtype="f16")
    back = read_map_file(p)
    assert set(back.g) == {4} and np.array_equal(back.g[4], g)
    t = {t.name: t for t in gguf.GGUFReader(p).tensors}[mapfile.tensor_name_state_gain(4)]
    assert t.name == "blk.4.ridgefill_state_gain.weight"
    assert t.tensor_type == gguf.GGMLQuantizationType.F32 and list(t.shape) == [4]
    plain = write_map_file(tmp_path / "plain.gguf", _maps())
    assert read_map_file(plain).g == {}
    assert mapfile.map_tensor_bytes(p) == mapfile.map_tensor_bytes(plain) + 4 * 4


@pytest.mark.parametrize("gains, message", [
    ({4: np.array([1.0, np.nan], np.float32)}, "layer 4: the state gains have NaN or Inf"),
    ({4: np.array([1.0, -0.5], np.float32)}, "layer 4: state gains must be positive"),
    ({4: np.array([1.0, 0.0], np.float32)}, "must be positive"),
    ({4: np.ones((2, 2), np.float32)}, "expected one per value head"),
    ({3: np.ones(2, np.float32)}, r"state gains for layers \[3\] that have no map"),
    ({4: np.ones(2, np.float32), 5: np.ones(3, np.float32)}, "different lengths"),
])
def test_bad_gains_are_refused_on_write_and_on_read(tmp_path, monkeypatch, gains, message):
    bad = _maps(gains)
    with pytest.raises(MapFileError, match=message):
        write_map_file(tmp_path / "bad.gguf", bad)
    assert not (tmp_path / "bad.gguf").exists()
    monkeypatch.setattr(mapfile, "check_maps", lambda maps: None)  # write it anyway, to test the reader
    p = write_map_file(tmp_path / "bad.gguf", bad)
    monkeypatch.undo()
    with pytest.raises(MapFileError, match=message):
        read_map_file(p)


def test_tuned_defaults_and_add_state_gains_keep_each_other(tmp_path):
    import gguf

    from ridgefill_cpp.fitting.state_gains import add_state_gains

    g = np.array([0.5, 0.8], dtype=np.float32)
    p = write_map_file(tmp_path / "m.gguf", _maps({4: g}), dtype="f16")
    mapfile.write_tuned_defaults(p, {"tail": 12, "exact_fraction": 0.25, "selector": "none"})
    back = read_map_file(p)
    assert np.array_equal(back.g[4], g) and mapfile.read_tuned_defaults(p)["tail"] == 12

    # new gains replace the old ones; the tuned keys and the F16 A (bytes) stay
    a_before = {t.name: np.array(t.data) for t in gguf.GGUFReader(p).tensors if t.name.endswith("ridgefill_a.weight")}
    g2 = np.array([1.5, 1.25], dtype=np.float32)
    add_state_gains(p, {4: g2})
    r = gguf.GGUFReader(p)
    names = [t.name for t in r.tensors]
    assert names.count(mapfile.tensor_name_state_gain(4)) == 1 and len(names) == 5
    for t in r.tensors:
        if t.name in a_before:
            assert t.tensor_type == gguf.GGMLQuantizationType.F16 and np.array_equal(np.array(t.data), a_before[t.name])
    assert np.array_equal(read_map_file(p).g[4], g2)
    assert mapfile.read_tuned_defaults(p)["exact_fraction"] == 0.25
    # bad gains: refused, the file is left as it was
    digest = p.read_bytes()
    with pytest.raises(MapFileError, match="must be positive"):
        add_state_gains(p, {4: np.array([1.0, -1.0])})
    with pytest.raises(MapFileError, match="no map"):
        add_state_gains(p, {2: np.array([1.0, 1.0])})
    assert p.read_bytes() == digest
    # another output: the source is untouched
    out = add_state_gains(p, {4: g}, tmp_path / "other.gguf")
    assert np.array_equal(read_map_file(out).g[4], g) and p.read_bytes() == digest
    assert [q.name for q in tmp_path.iterdir() if q.name.startswith(".")] == []


SETTINGS = {"tail": 12, "exact_fraction": 0.1, "selector": "probe", "value_rescale": 256, "windows": 5,
            "window_rows": 96}


def test_gain_settings_round_trip_through_add_state_gains(tmp_path):
    import gguf

    from ridgefill_cpp.fitting.state_gains import add_state_gains

    g = np.array([0.5, 0.8], dtype=np.float32)
    p = write_map_file(tmp_path / "m.gguf", _maps({4: g}))
    assert read_map_file(p).state_gain_settings == {}  # a file without the keys (as before they existed) reads
    mapfile.write_tuned_defaults(p, {"tail": 20, "exact_fraction": 0.3, "selector": "none"})
    add_state_gains(p, {4: g}, settings=SETTINGS)
    back = read_map_file(p)
    assert back.state_gain_settings == SETTINGS and np.array_equal(back.g[4], g)
    fields = gguf.GGUFReader(p).fields
    kinds = {mapfile.KEY_STATE_GAIN_TAIL: gguf.GGUFValueType.UINT32,
             mapfile.KEY_STATE_GAIN_FRACTION: gguf.GGUFValueType.FLOAT32,
             mapfile.KEY_STATE_GAIN_SELECTOR: gguf.GGUFValueType.STRING,
             mapfile.KEY_STATE_GAIN_VALUE_RESCALE: gguf.GGUFValueType.UINT32,
             mapfile.KEY_STATE_GAIN_WINDOWS: gguf.GGUFValueType.UINT32,
             mapfile.KEY_STATE_GAIN_WINDOW_ROWS: gguf.GGUFValueType.UINT32}
    assert {k: fields[k].types[0] for k in kinds} == kinds
    assert fields["ridgefill.state_gain.selector"].contents() == "probe"
    assert mapfile.read_tuned_defaults(p)["tail"] == 20  # the tuned keys stay

    # new gains with new settings: the old keys are replaced, not merged
    add_state_gains(p, {4: g * 2}, settings={"tail": 32, "selector": "attention"})
    assert read_map_file(p).state_gain_settings == {"tail": 32, "selector": "attention"}
    assert sum(k.startswith(mapfile.STATE_GAIN_PREFIX) for k in gguf.GGUFReader(p).fields) == 2
    # new gains without settings: the file no longer claims an operating point
    add_state_gains(p, {4: g}, settings=None)
    assert read_map_file(p).state_gain_settings == {}
    # gains removed: their keys go with them
    add_state_gains(p, {4: g}, settings=SETTINGS)
    add_state_gains(p, {}, settings=SETTINGS)
    back = read_map_file(p)
    assert back.g == {} and back.state_gain_settings == {}
    assert not any(k.startswith(mapfile.STATE_GAIN_PREFIX) for k in gguf.GGUFReader(p).fields)
    assert mapfile.read_tuned_defaults(p)["tail"] == 20
    # bad settings: refused, the file left as it was
    digest = p.read_bytes()
    for bad, message in (({"tails": 3}, "unknown state-gain settings: tails"),
                         ({"tail": -1}, "non-negative integer"), ({"tail": 2.5}, "non-negative integer"),
                         ({"exact_fraction": 1.5}, r"outside \[0, 1\]"), ({"selector": ""}, "must not be empty")):
        with pytest.raises(ValueError, match=message):
            add_state_gains(p, {4: g}, settings=bad)
    assert p.read_bytes() == digest

    # write_map_file writes RidgeMaps.state_gain_settings with the gains (and none without gains)
    m = _maps({4: g})
    m.state_gain_settings = dict(SETTINGS)
    assert read_map_file(write_map_file(tmp_path / "w.gguf", m)).state_gain_settings == SETTINGS
    m = _maps()
    m.state_gain_settings = dict(SETTINGS)
    assert not any(k.startswith(mapfile.STATE_GAIN_PREFIX)
                   for k in gguf.GGUFReader(write_map_file(tmp_path / "n.gguf", m)).fields)


def test_ill_typed_or_unknown_gain_settings_are_refused_on_read(tmp_path):
    import gguf

    p = write_map_file(tmp_path / "m.gguf", _maps({4: np.ones(2, np.float32)}))
    for key, value, kind, message in (
            (mapfile.KEY_STATE_GAIN_TAIL, "64", gguf.GGUFValueType.STRING, "is not a uint32"),
            ("ridgefill.state_gain.colour", 1, gguf.GGUFValueType.UINT32, "unknown state-gain key")):
        bad = mapfile.rewrite_map_file(p, tmp_path / "bad.gguf", add_keys=[(key, value, kind)])
        with pytest.raises(MapFileError, match=message):
            read_map_file(bad)


def test_info_shows_the_gain_settings(cli, tmp_path):
    from ridgefill_cpp.fitting.state_gains import add_state_gains

    g = np.array([0.5, 0.8], dtype=np.float32)
    p = write_map_file(tmp_path / "m.gguf", _maps({4: g}))
    res = cli("info", "--json", p)
    assert res.exit_code == 0, res.output
    d = json.loads(res.output)
    assert d["has_state_gains"] and d["state_gain_settings"] == {}
    assert "operating point not recorded" in cli("info", p).output
    add_state_gains(p, {4: g}, settings=SETTINGS)
    d = json.loads(cli("info", "--json", p).output)
    assert d["state_gain_settings"] == SETTINGS
    res = cli("info", p)
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())
    for part in ("fitted at T = 12", "exact fraction 0.1", "selector probe", "value rescale 256", "5 windows of 96 rows"):
        assert part in text, res.output
    plain = write_map_file(tmp_path / "plain.gguf", _maps())
    d = json.loads(cli("info", "--json", plain).output)
    assert d["has_state_gains"] is False and d["state_gain_settings"] is None


@pytest.mark.parametrize("dtype", [np.float16, np.float64])
def test_gain_tensors_that_are_not_f32_are_refused(tmp_path, dtype):
    """The C++ loader takes F32 gains only; the Python reader says so instead of converting."""
    import gguf

    m = _maps()
    path = tmp_path / "f16-gains.gguf"
    w = gguf.GGUFWriter(path, "qwen35")  # written with gguf-py directly, keys as write_map_file writes them
    src = gguf.GGUFReader(write_map_file(tmp_path / "src.gguf", m, dtype="f32"))
    for name, fld in src.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        kind = fld.types[0]
        w.add_key_value(name, fld.contents(), kind,
                        sub_type=fld.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
    for t in src.tensors:
        w.add_tensor(t.name, np.array(t.data))
    w.add_tensor(mapfile.tensor_name_state_gain(4), np.array([0.5, 1.5], dtype=dtype))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    del src
    kind = {t.name: t.tensor_type for t in gguf.GGUFReader(path).tensors}[mapfile.tensor_name_state_gain(4)]
    assert kind == (gguf.GGMLQuantizationType.F16 if dtype == np.float16 else gguf.GGMLQuantizationType.F64)
    with pytest.raises(MapFileError, match=rf"blk\.4\.ridgefill_state_gain\.weight is {kind.name}, "
                                           r"state gains must be F32"):
        read_map_file(path)


# -- fitted with llama.cpp on the tiny qwen35 ----------------------------------------------------


@pytest.fixture(scope="module")
def qwen35(tiny_models, tmp_path_factory):
    """(model, F32 map file at S = 3, calibration windows of CTX rows)."""
    from ridgefill_cpp.fitting.state_gains import calibration_windows

    model = tiny_models["qwen35"]
    res = fit_ridge_maps(model, corpus.default_documents("calibration"),
                         FitOptions(n_tokens=4000, ctx=CTX, split=SPLIT, n_threads=1))
    # F32 A: an F16 A makes ggml round the filled rows' input to F16 in the matrix product, which the
    # oracle does not (measured: 6e-5 relative on the gains instead of 8e-6)
    path = write_map_file(tmp_path_factory.mktemp("gains") / "q.ridgefill.gguf", res.maps, dtype="f32")
    windows = calibration_windows(model, corpus.default_documents("calibration"), n_tokens=4000, ctx=CTX,
                                  max_windows=4)
    assert len(windows) == 4 and all(len(w) == CTX for w in windows)
    return model, path, windows


@pytest.fixture(scope="module")
def gains(qwen35):
    from ridgefill_cpp.fitting.state_gains import fit_state_gains

    model, path, windows = qwen35
    return fit_state_gains(model, path, windows, tail=TAIL, fraction=FRACTION, n_threads=1)


def test_gains_for_the_mapped_recurrent_layer_only(qwen35, gains):
    from ridgefill_cpp.fitting.state_gains import ssm_shape

    n_v, s_v = ssm_shape(qwen35[0])
    assert set(gains) == {4}
    g = gains[4]
    assert g.shape == (n_v,) and g.dtype == np.float32
    assert np.isfinite(g).all() and (g > 0).all()
    assert np.abs(g - 1).max() > 1e-3  # the filled state is off, and the gains say so
    print("tiny qwen35 state gains, layer 4:", g)


def test_gains_are_the_least_squares_gains_of_the_readouts(qwen35):
    from ridgefill_cpp.fitting.state_gains import boundary_states, fit_state_gains

    model, path, windows = qwen35
    pairs = {}
    layers = boundary_states(model, path, windows[:2], tail=TAIL, fraction=FRACTION, n_threads=1,
                             on_pair=lambda i, e, f: pairs.__setitem__(i, (e, f)))
    assert layers == [4] and sorted(pairs) == [0, 1]
    e0, f0 = pairs[0]
    assert e0[4].shape == f0[4].shape and e0[4].ndim == 3 and e0[4].shape[1] == e0[4].shape[2]
    assert np.linalg.norm(f0[4] - e0[4]) > 1e-3 * np.linalg.norm(e0[4])  # filled != exact
    num = sum((e[4] * f[4]).sum(axis=(1, 2)) for e, f in pairs.values())
    den = sum((f[4] * f[4]).sum(axis=(1, 2)) for e, f in pairs.values())
    g = fit_state_gains(model, path, windows[:2], tail=TAIL, fraction=FRACTION, n_threads=1)[4]
    np.testing.assert_allclose(g, num / den, rtol=1e-6)

    def sq_error(gg):
        return sum(float(((f[4] * gg[:, None, None] - e[4]) ** 2).sum()) for e, f in pairs.values())

    best = sq_error(g.astype(np.float64))
    for h in range(g.size):
        for d in (-1e-3, 1e-3):
            gg = g.astype(np.float64)
            gg[h] += d
            assert sq_error(gg) > best


def test_gains_agree_with_the_oracle(qwen35, gains):
    """The float64 oracle's gains for the same windows, maps, tail, fraction and selector: its exact
    state comes from the plan with every prefix row exact, llama.cpp's from stock prefill."""
    import torch

    from ridgefill_cpp.oracle import load_oracle
    from ridgefill_cpp.oracle.state_correction import fit_state_gains as oracle_gains

    model, path, windows = qwen35
    oracle = load_oracle(model, dtype=torch.float64)
    want = oracle_gains(oracle, windows, split=SPLIT, maps=read_map_file(path), tail=TAIL, fraction=FRACTION)
    assert set(want) == {3, 4}  # layer S too (its boundary state is exact: gain 1), not stored in map files
    rel = np.abs(gains[4].astype(np.float64) / want[4].numpy() - 1).max()
    print(f"C++ vs oracle state gains: max relative difference {rel:.2e}")
    assert rel < 1e-4


def test_unusable_input_is_refused_clearly(qwen35, tiny_models, tmp_path):
    from ridgefill_cpp.fitting.state_gains import fit_state_gains

    model, path, windows = qwen35
    with pytest.raises(FitError, match="no calibration windows"):
        fit_state_gains(model, path, [], tail=TAIL, n_threads=1)
    with pytest.raises(FitError, match=f"window of {TAIL} tokens is not longer than the tail"):
        fit_state_gains(model, path, [windows[0], windows[1][:TAIL]], tail=TAIL, n_threads=1)
    llama = tiny_models["llama"]
    res = fit_ridge_maps(llama, corpus.default_documents("calibration"),
                         FitOptions(n_tokens=3000, ctx=CTX, split=SPLIT, n_threads=1))
    dense = write_map_file(tmp_path / "llama.gguf", res.maps)
    with pytest.raises(FitError, match="no Gated DeltaNet .* layer above the split S = 3"):
        fit_state_gains(llama, dense, windows, tail=TAIL, n_threads=1)


# -- the CLI and the runtime ----------------------------------------------------------------------


def test_cli_fit_state_gains_then_prefill_with_them(cli, tiny_models, tmp_path):
    from ridgefill_cpp.quality.bench import last_logits as logits_of
    from ridgefill_cpp.runtime.prefill import Llama, RidgeFill

    model = tmp_path / "q.gguf"
    shutil.copy(tiny_models["qwen35"], model)
    args = ("--tokens", 3000, "--ctx", CTX, "--split", SPLIT, "--threads", 1, "--state-gain-windows", 3)
    res = cli("fit", model, *args, "-o", tmp_path / "gains.gguf")
    assert res.exit_code == 0, res.output
    assert "terminal-state gains" in res.output and "wrote the state gains" in res.output
    with_gains = read_map_file(tmp_path / "gains.gguf")
    assert set(with_gains.g) == {4} and (with_gains.g[4] > 0).all()
    # the operating point the gains were fitted at: fit's built-in plan, on 3 windows of --ctx rows
    fitted_at = {"tail": 64, "exact_fraction": 0.1, "selector": "attention", "value_rescale": 512, "windows": 3,
                 "window_rows": CTX}
    assert with_gains.state_gain_settings == fitted_at
    res = cli("fit", model, *args, "--no-state-gains", "-o", tmp_path / "plain.gguf")
    assert res.exit_code == 0, res.output
    assert read_map_file(tmp_path / "plain.gguf").g == {} and "state gains" not in res.output

    res = cli("info", "--json", tmp_path / "gains.gguf")
    assert res.exit_code == 0, res.output
    d = json.loads(res.output)
    assert d["has_state_gains"] and d["state_gains"]["4"] == pytest.approx([float(x) for x in with_gains.g[4]])
    assert d["state_gain_settings"] == fitted_at
    assert json.loads(cli("info", "--json", tmp_path / "plain.gguf").output)["has_state_gains"] is False
    res = cli("info", tmp_path / "gains.gguf", "--model", model)
    assert res.exit_code == 0 and "state gains" in res.output and "the maps fit" in res.output
    assert "fitted at T = 64, exact fraction 0.1, selector attention, value rescale 512" in " ".join(res.output.split())
    assert "fit --state-gains" in cli("info", tmp_path / "plain.gguf").output
    # gains that do not fit the model: info --model says why
    from ridgefill_cpp.fitting.state_gains import add_state_gains

    for gains, message in (({4: np.ones(3)}, "3 per layer, the model has 4 value heads"),
                           ({4: np.ones(4), 5: np.ones(4)}, "mapped recurrent layers are [4]")):
        bad = add_state_gains(tmp_path / "gains.gguf", gains, tmp_path / "bad.gguf")
        res = cli("info", bad, "--model", model)
        assert res.exit_code == 1 and message in res.output, res.output

    # the runtime: state_correction="gain" needs the gains, and with them prefills a 160-token prompt
    prompt = evaluation_tokens(model, 160)
    kw = dict(n_ctx=256, n_batch=256, n_ubatch=256, n_threads=1, verbose=False)

    def last_logits(maps, correction):
        rf = RidgeFill(str(maps), tail=TAIL, exact_fraction=FRACTION, min_prompt=0, state_correction=correction)
        llm = Llama(str(model), ridgefill=rf, **kw)
        try:
            llm.eval(prompt)
            assert llm.ridgefill_stats["n_filled"] > 0
            return logits_of(llm)
        finally:
            llm.close()

    corrected = last_logits(tmp_path / "gains.gguf", "gain")
    plain = last_logits(tmp_path / "gains.gguf", None)
    assert np.isfinite(corrected).all() and np.isfinite(plain).all()
    assert np.abs(corrected - plain).max() > 1e-6 * np.abs(plain).max()  # the gains reach the logits
    with pytest.raises(ValueError, match="--state-gains"):
        last_logits(tmp_path / "plain.gguf", "gain")


def test_cli_state_gains_on_a_dense_model_is_ignored_with_a_note(cli, tiny_models, tmp_path):
    res = cli("fit", tiny_models["llama"], "--tokens", 3000, "--ctx", CTX, "--threads", 1, "--state-gains",
              "-o", tmp_path / "l.gguf")
    assert res.exit_code == 0, res.output
    assert "--state-gains ignored" in res.output and read_map_file(tmp_path / "l.gguf").g == {}
    res = cli("fit", tiny_models["qwen35"], "--tokens", 3000, "--ctx", 64, "--split", SPLIT, "-o", tmp_path / "q.gguf")
    assert res.exit_code == 1 and "longer than the tail" in res.output and "--no-state-gains" in res.output
    assert not (tmp_path / "q.gguf").exists()
