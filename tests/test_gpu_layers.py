"""``--n-gpu-layers`` and ``--device`` on fit, bench, eval, tune and demo, and what fit says before its work.

The offload itself needs a GPU; here: the options reach every model the five commands load, the
values llama.cpp's -ngl takes (a count, ``all``) and nothing else, the device names llama.cpp's
--device takes (``none``, a device of this build) and nothing else, a CPU build says that the layers
stay on the CPU, the maps of ``-ngl 0``, ``-ngl all`` and ``-ngl all --device none`` are the same bit
for bit, and the fit's estimate (time and memory after its first windows) adds up."""

from __future__ import annotations

import ctypes
import pickle
import re

import numpy as np
import pytest

import ridgefill_cpp  # first: llama_cpp then loads the patched libraries
import llama_cpp  # noqa: E402
from ridgefill_cpp.cli.app import gpu_backends
from ridgefill_cpp.cli.fit import duration, estimate_text
from ridgefill_cpp.core.machine import measured_on, measured_text
from ridgefill_cpp.fitting import corpus
from ridgefill_cpp.fitting.fit import (ESTIMATE_AFTER_WINDOWS, FitEstimate, FitOptions, expected_peak_bytes,
                                       fit_ridge_maps_for_splits, solve_flops, window_plan)
from ridgefill_cpp.maps.mapfile import read_map_file
from ridgefill_cpp.quality.tune import TuneOptions
from ridgefill_cpp.runtime import devices
from ridgefill_cpp.runtime.prefill import Llama

CPU_BUILD = not gpu_backends(ridgefill_cpp.build_info()["backends"])


class Loaded(Exception):
    """Raised by the stand-in Llama constructor once it has seen what a command passes."""


@pytest.fixture
def first_load(monkeypatch):
    """The keyword arguments of the first Llama a command creates (the command stops there)."""
    seen: list[dict] = []

    def init(self, *args, **kwargs):
        # the device list llama-cpp-python's Llama would load with (NULL: llama.cpp's default, every GPU)
        listed = llama_cpp.llama_cpp.llama_model_default_params().devices
        seen.append({**kwargs, "devices": None if not listed else ctypes.cast(listed, ctypes.POINTER(ctypes.c_void_p))})
        raise Loaded()

    monkeypatch.setattr(Llama, "__init__", init)
    return seen


@pytest.fixture(scope="module")
def tiny_maps(tiny_models, tmp_path_factory):
    """Maps of the tiny llama model at S = 3 (a small fit)."""
    from ridgefill_cpp.fitting.fit import fit_ridge_maps
    from ridgefill_cpp.maps.mapfile import write_map_file

    res = fit_ridge_maps(tiny_models["llama"], corpus.default_documents("calibration"),
                         FitOptions(n_tokens=3000, ctx=128, split=3))
    return write_map_file(tmp_path_factory.mktemp("maps") / "m.gguf", res.maps)


@pytest.fixture
def command_args(tiny_models, tiny_maps, tmp_path):
    """Per command, arguments that get it as far as loading the model."""
    model, maps = tiny_models["llama"], tiny_maps
    return {
        "fit": (model, "-o", tmp_path / "o.gguf", "--tokens", 3000, "--ctx", 128),
        "bench": (model, "--lengths", 64, "--repeats", 1),
        "eval": (model, "--maps", maps, "--quick", "--out", tmp_path / "r"),
        "eval --ruler": (model, "--maps", maps, "--ruler", "--ruler-tasks", "niah_single_1", "--samples", 1,
                         "--lengths", 1024, "--out", tmp_path / "ruler"),
        "tune": (model, "--maps", maps, "--budget", 0.1, "--dry-run", "--tails", 16, "--fractions", 0.1,
                 "--length", 256, "--docs", 2, "--retrieval-prompts", 0),
        "demo": ("--model", model, "--fit-tokens", 1000),
    }


@pytest.mark.parametrize("command", ["fit", "bench", "eval", "eval --ruler", "tune", "demo"])
@pytest.mark.parametrize("value, n", [(None, 0), ("0", 0), ("3", 3), ("all", -1), ("ALL", -1)])
def test_every_command_passes_the_gpu_layers_to_the_model(cli, command_args, first_load, command, value, n):
    name = command.split()[0]
    args = command_args[command] + (() if value is None else ("--n-gpu-layers", value))
    r = cli(name, *args)
    assert isinstance(r.exception, Loaded), (command, r.output, r.exception)
    assert first_load and first_load[0]["n_gpu_layers"] == n, (command, first_load)


@pytest.mark.parametrize("command", ["fit", "bench", "eval", "eval --ruler", "tune", "demo"])
def test_every_command_offloads_to_the_devices_given(cli, command_args, first_load, command):
    name = command.split()[0]
    r = cli(name, *command_args[command], "-ngl", "all")
    assert isinstance(r.exception, Loaded), (command, r.output, r.exception)
    assert first_load[0]["devices"] is None  # no --device: llama.cpp's own choice, every GPU
    first_load.clear()
    r = cli(name, *command_args[command], "-ngl", "all", "--device", "none")
    assert isinstance(r.exception, Loaded), (command, r.output, r.exception)
    listed = first_load[0]["devices"]
    assert listed is not None and listed[0] is None  # an empty NULL-terminated list: no offload
    # and nothing is left behind for the next model the process loads
    assert not llama_cpp.llama_cpp.llama_model_default_params().devices and devices.current_devices() is None


@pytest.mark.parametrize("bad, why", [("CUDA0", "invalid device: CUDA0"), ("CPU", "the CPU is not a device to offload to"),
                                      ("", "no device named"), ("none,", "an empty name")])
def test_device_refuses_what_llama_cpp_does_not_take(cli, command_args, first_load, bad, why):
    if bad == "CUDA0" and any(d.name == "CUDA0" for d in devices.offload_devices()):
        pytest.skip("this machine has a CUDA0")
    for command in ("fit", "bench", "eval", "tune", "demo"):
        r = cli(command, *command_args[command], "--device", bad)
        assert r.exit_code == 1 and not first_load, (command, bad, r.output)
        assert f"--device {bad}: " in r.output and why in r.output, r.output
        assert "this build's offload devices here: " in r.output or "no device named" in why or "empty" in why


def test_device_names_and_lists_as_llama_cpp_parses_them():
    there = devices.offload_devices()
    assert all(d.type != "CPU" and d.name for d in there)
    assert devices.device_names("none") == [] and list(devices.device_list("none")) == [None]
    if there:  # a GPU build on a machine with its GPU: names in the order given, NULL-terminated
        names = [d.name for d in there]
        assert devices.device_names(",".join(names)) == names
        listed = list(devices.device_list(names))
        assert len(listed) == len(names) + 1 and listed[-1] is None and all(listed[:-1])
    with pytest.raises(ValueError, match="invalid device: Vulkan9"):
        devices.device_list(["Vulkan9"])
    with devices.loading_on_devices("none") as names:
        assert names == [] and devices.current_devices() == []
        listed = llama_cpp.llama_cpp.llama_model_default_params().devices
        assert ctypes.cast(listed, ctypes.POINTER(ctypes.c_void_p))[0] is None
    assert devices.current_devices() is None and not llama_cpp.llama_cpp.llama_model_default_params().devices


def test_llama_with_no_offload_device_computes_what_plain_llama_does(tiny_models):
    """``Llama(devices="none", n_gpu_layers=-1)`` keeps every layer on the CPU: the same logits as a
    plain load, bit for bit; a name that is not a device, or devices with rpc_servers, fail before the load."""
    tokens = list(range(5, 69))
    logits = []
    for kw in ({}, {"devices": "none", "n_gpu_layers": -1}):
        llm = Llama(str(tiny_models["llama"]), n_ctx=128, n_threads=1, verbose=False, **kw)
        try:
            logits.append(llm.prefill(tokens, n_logits=4))
            placed = llm.layer_devices()
            assert placed and all(p.startswith("CPU") for p in placed), placed
            if kw:  # a copy loads on the same devices
                assert llm.devices == []
                twin = pickle.loads(pickle.dumps(llm))
                try:
                    assert twin.devices == [] and np.array_equal(twin.prefill(tokens, n_logits=4), logits[-1])
                finally:
                    twin.close()
        finally:
            llm.close()
    assert np.isfinite(logits[0]).all() and np.array_equal(logits[0], logits[1])
    with pytest.raises(ValueError, match="invalid device: NoSuchGPU"):
        Llama(str(tiny_models["llama"]), devices="NoSuchGPU", verbose=False)
    with pytest.raises(ValueError, match="devices and rpc_servers: give one"):
        Llama(str(tiny_models["llama"]), devices="none", rpc_servers="127.0.0.1:1", verbose=False)


@pytest.mark.parametrize("bad", ["-1", "-3", "x", "1.5", ""])
def test_gpu_layers_refuses_what_llama_cpp_does_not_take(cli, command_args, first_load, bad):
    for command in ("fit", "bench", "tune"):
        r = cli(command, *command_args[command], "--n-gpu-layers", bad)
        assert r.exit_code == 1 and not first_load, (command, bad, r.output)
        assert "--n-gpu-layers must be a number of layers (0 or more) or all" in r.output


@pytest.mark.skipif(not CPU_BUILD, reason="a build with a GPU backend offloads: no note")
def test_a_cpu_build_says_the_layers_stay_on_the_cpu(cli, command_args, first_load):
    r = cli("bench", *command_args["bench"], "-ngl", "all")
    assert "this build has no GPU backend" in r.output and "every layer runs on the CPU" in r.output
    r = cli("bench", *command_args["bench"], "-ngl", "0")
    assert "GPU backend" not in r.output


def test_fit_with_every_layer_offloaded_writes_the_same_maps(cli, tiny_models, tmp_path):
    """On this build both run on the CPU: the same numbers bit for bit (on a GPU build ``-ngl all``
    runs the capture there; docs/gpu-h200 measures it)."""
    paths = {}
    for value in ("0", "all", "all --device none"):
        paths[value] = tmp_path / f"ngl-{value.replace(' ', '')}.gguf"
        r = cli("fit", tiny_models["llama"], "-o", paths[value], "--tokens", 3000, "--ctx", 128, "--split", 3,
                "--dtype", "f32", "-ngl", *value.split())
        assert r.exit_code == 0, r.output
    a = read_map_file(paths["0"])
    for other in ("all", "all --device none"):
        b = read_map_file(paths[other])
        assert a.meta.layers == b.meta.layers == [4, 5]
        for il in a.meta.layers:
            assert np.array_equal(a.a[il], b.a[il]) and np.array_equal(a.b[il], b.b[il])
        assert a.meta.r2 == b.meta.r2 and a.meta.lambdas == b.meta.lambdas


def test_fit_says_what_it_will_take_after_its_first_windows(tiny_models):
    seen: list[FitEstimate] = []
    windows: list[int] = []
    res = fit_ridge_maps_for_splits(tiny_models["llama"], corpus.default_documents("calibration"), [3, 4],
                                    FitOptions(n_tokens=4000, ctx=128),
                                    progress=lambda done, total: windows.append(done), on_estimate=seen.append)
    assert len(seen) == 1
    est = seen[0]
    assert est.tokens == res[0].maps.meta.calib_n_tokens == windows[-1]
    assert est.tokens_per_s > 0 and est.capture_s > 0 and est.solve_s > 0
    assert est.total_s == est.capture_s + est.solve_s
    # the peak adds at least the statistics' held-out rows and maps of both splits to what is resident
    assert est.peak_bytes > est.rss_bytes > 0
    assert est.peak_bytes - est.rss_bytes >= sum(len(r.maps.meta.layers) * 64 * 64 * 4 for r in res)


def test_a_fit_of_few_windows_says_nothing(tiny_models):
    seen: list[FitEstimate] = []
    n_bos = 1
    # the smallest fit the tiny model takes (65 unknowns): fewer windows than the estimate waits for?
    plan = window_plan(3000, [128], n_bos, 10)
    assert len(plan) > ESTIMATE_AFTER_WINDOWS  # so the fit below is the case where it speaks
    fit_ridge_maps_for_splits(tiny_models["llama"], corpus.default_documents("calibration"), [3],
                              FitOptions(n_tokens=3000, ctx=128), on_estimate=seen.append)
    assert len(seen) == 1
    seen.clear()
    fit_ridge_maps_for_splits(tiny_models["llama"], corpus.default_documents("calibration"), [3],
                              FitOptions(n_tokens=3 * 127, ctx=128, holdout_every=2, max_heldout_rows=64),
                              on_estimate=seen.append)
    assert seen == []


def test_expected_peak_by_hand():
    d = 10
    # one split, 2 late layers, 30 held-out rows of 50 still to come
    growth = 30 * d * 3 * 8
    kept = 2 * d * (d + 1) * 4 + 50 * d * 3 * 4 + d * d * 8
    transient = 8 * d * d * 8 + 4 * 50 * d * 8 + 2 * d * d * 4
    assert expected_peak_bytes(1000, d, [(2, 30, 50)]) == 1000 + growth + kept + transient
    # a second split adds its growth and what it keeps; the transient is the larger of the two
    two = expected_peak_bytes(1000, d, [(2, 30, 50), (3, 0, 50)])
    assert two == (1000 + growth + kept + 0 + 3 * d * (d + 1) * 4 + 50 * d * 4 * 4 + d * d * 8
                   + 8 * d * d * 8 + 4 * 50 * d * 8 + 3 * d * d * 4)
    assert solve_flops(d, 2, 50) == 9 * d**3 + 2 * (6 * d**3 + 4 * 50 * d * d)


def test_estimate_text_and_the_warning_past_an_hour():
    est = FitEstimate(tokens=100_000, tokens_per_s=50.0, capture_s=2000.0, solve_s=40.0, rss_bytes=2 * 2**30,
                      peak_bytes=int(3.5 * 2**30))
    text = estimate_text(est, 1)
    assert text.startswith("estimate: the fit takes about 34 min (capture of 100,000 tokens at 50 tokens/s: 33 min; "
                           "solve of 1 split: 40 s); peak memory about 3.5 GiB (2.0 GiB resident now)")
    assert "warning" not in text
    # tune --fit: the tune after the fit, and past an hour a warning with the budget and the grid
    text = estimate_text(est, 5, lambda rate: ("the tune over 240 settings", 250_000 / rate))
    assert "solve of 5 splits" in text and "then the tune over 240 settings: about 83 min, 1 h 57 min in all" in text
    assert re.search(r"warning:.* more than an hour on this machine: a smaller calibration budget \(--fit-tokens "
                     r"25,000 saves about 25 min\) or a smaller grid \(fewer splits in --fit", text), text
    # fit alone past an hour: the budget only
    long = FitEstimate(tokens=100_000, tokens_per_s=20.0, capture_s=5000.0, solve_s=60.0, rss_bytes=1, peak_bytes=2)
    text = estimate_text(long, 1)
    assert "(--tokens 25,000 saves about 62 min)" in text and "grid" not in text
    assert [duration(s) for s in (0.2, 45, 89.6, 120, 5399, 5400, 7260)] == \
        ["0 s", "45 s", "2 min", "2 min", "90 min", "1 h 30 min", "2 h 1 min"]


def test_tune_counts_what_it_prefills():
    o = TuneOptions(tails=(32, 64), fractions=(0.0, 0.1, 0.2), spans=(1, 16), key_rescales=(0,), length=2048,
                    n_docs=8, retrieval_prompts=5)
    assert o.n_points(3) == 3 * 2 * 3 * 2 * 1
    assert o.prefill_tokens(3) == 2048 * (8 + 5) * (1 + 36)


def test_measurements_record_the_gpu_layers():
    m = measured_on(2, -1)
    assert m["n_gpu_layers"] == -1 and measured_text(m).endswith(", all layers offloaded")
    assert measured_text(measured_on(2, 12)).endswith(", 12 layers offloaded")
    m = measured_on(2)
    assert m["n_gpu_layers"] == 0 and "offloaded" not in measured_text(m)
    with devices.loading_on_devices("none"):
        m = measured_on(2, -1)
    assert m["devices"] == [] and measured_text(m).endswith(", all layers offloaded, devices none")
    assert "devices" not in measured_on(2)
