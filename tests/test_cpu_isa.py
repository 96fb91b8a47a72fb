"""The CPU paths the native build picks on this machine, and the AMX tile configuration.

The build compiles llama.cpp for the machine it runs on (``-march=native``), so on an Intel Xeon
with AMX it includes ggml's AMX matrix kernels (and AVX-512 VNNI / BF16 paths), and on other CPUs
it does not. Two kinds of check:

* Every weight type the tests and the real models use runs a prompt (a many-row batch and a
  one-row batch, which take different kernels) in a child process, and its logits agree with the
  float64 oracle on the dequantized weights within quantisation noise, with llama.cpp's extra
  weight buffers (AMX, CPU_REPACK) and without them. A kernel that faults shows up as the child's
  signal. On a CPU that offers AMX, the AMX buffer must really hold the weights of the types it has
  kernels for, so the tile path is the one under test.
* The AMX tile configuration reaches ``ldtilecfg`` whole (patches/0008): the pinned ggml built its
  config on the stack, and GCC's ``_tile_loadconfig`` names only the config's first 8 bytes as read,
  so GCC dropped the stores of the tile shapes and the first tile load faulted (SIGILL). This is
  checked on the machine code of ggml's AMX kernels, compiled for an AMX target with the build's
  compiler, so it runs on any x86-64 machine; the unpatched source must fail the same check.
"""

from __future__ import annotations

import json
import re
import shutil
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

import ridgefill_cpp

REPO = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent

#: llama.cpp file types (enum llama_ftype) of the weight types under test: the tiny models' F32 / F16,
#: SmolLM2's Q4_1, Gemma 3's Q4_K / Q5_0 / Q6_K / Q8_0, and Q4_0 / BF16, which have their own kernels
FTYPES = {"F32": 0, "F16": 1, "BF16": 32, "Q8_0": 7, "Q5_0": 8, "Q4_0": 2, "Q4_1": 3, "Q4_K": 14, "Q6_K": 18}

#: types whose matrices llama.cpp's AMX buffer takes (ggml-cpu/amx/common.h, qtype_has_amx_kernels,
#: with the 32-wide blocks whose shapes the tiny model below always satisfies)
AMX_TYPES = ("Q4_0", "Q4_1", "Q8_0")

#: relative error of all rows' logits against the float64 oracle: float rounding for F32 / F16,
#: BF16 rounding, and for quantized weights the 8-bit quantisation of activations that llama.cpp
#: applies (measured on an AVX2 build: F32 2.4e-4, F16 5.7e-4, BF16 4.2e-3, 8-bit and 5-bit
#: 1.5e-2 to 1.6e-2, Q4_K / Q6_K 2.2e-2); the bounds leave about 2x
TOLERANCE = {"F32": 1e-3, "F16": 2e-3, "BF16": 1e-2}
TOLERANCE_QUANTIZED = 5e-2


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    m = re.search(r"^flags\s*:(.*)$", text, re.M)
    return set(m.group(1).split()) if m else set()


# --------------------------------------------------------------------------------------------
# prompts through every weight type


@pytest.fixture(scope="module")
def typed_models(tmp_path_factory) -> dict[str, Path]:
    """A tiny llama (n_embd 256 so that K-quant blocks and AMX tiles fit) in every type of FTYPES,
    quantized by llama.cpp itself with every matrix in that type."""
    import ctypes

    from ridgefill_cpp.testing import tiny_models as make_tiny_models
    from llama_cpp import llama_cpp as C

    root = tmp_path_factory.mktemp("isa-models")
    src = make_tiny_models.make_tiny_model("llama", root / "F32.gguf", seed=0, n_embd=256, n_head=4, n_head_kv=2,
                                           head_dim=64, n_ff=512, n_layer=2)
    out = {"F32": src}
    for name, ftype in FTYPES.items():
        if name == "F32":
            continue
        params = C.llama_model_quantize_default_params()
        params.ftype = ftype
        params.pure = True  # every matrix in this type, token embedding included
        params.nthread = 2
        dst = root / f"{name}.gguf"
        assert C.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params)) == 0, name
        out[name] = dst
    return out


def _prompt(model: Path, extra_bufts: bool, tokens: list[int], tmp_path: Path) -> tuple[dict, np.ndarray]:
    out = tmp_path / f"{model.stem}-{int(extra_bufts)}.npy"
    proc = subprocess.run([sys.executable, str(HERE / "prompt_child.py"), str(model), str(int(extra_bufts)), str(out),
                           ",".join(map(str, tokens))], capture_output=True, text=True, timeout=300)
    if proc.returncode < 0:
        import signal

        pytest.fail(f"{model.name}: llama.cpp died with {signal.Signals(-proc.returncode).name} "
                    f"(extra buffer types {'on' if extra_bufts else 'off'}); stderr:\n{proc.stderr[-3000:]}")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["decode"] == [0, 0], report
    return report, np.load(out)


def test_build_info_reports_the_cpu_paths(cli):
    info = ridgefill_cpp.build_info()
    features, bufts = info["cpu_features"], info["cpu_extra_buffer_types"]
    assert isinstance(features, dict) and isinstance(bufts, list)
    flags = _cpu_flags()
    if "avx2" in flags:
        assert features.get("AVX2") == "1", features  # -march=native on an AVX2 machine
    if "AMX_INT8" in features:
        # compiled in; offered only where the CPU has it (and the kernel grants the tile state)
        assert ("AMX" in bufts) == ("amx_int8" in flags), (features, bufts, sorted(f for f in flags if "amx" in f))
    else:
        assert "AMX" not in bufts
    res = cli("--version")
    assert res.exit_code == 0, res.output
    assert "CPU backend compiled with:" in res.output
    for name in features:
        assert name in res.output
    assert "CPU weight buffer types available here: CPU" in res.output
    for name in bufts:
        assert name in res.output


@pytest.mark.parametrize("wtype", list(FTYPES))
def test_prompt_through_each_weight_type_agrees_with_the_oracle(wtype, typed_models, tmp_path, record_property):
    from ridgefill_cpp.oracle import load_oracle

    model = typed_models[wtype]
    tokens = list(range(3, 3 + 65))  # a 64-row batch, then a one-row batch
    ref = load_oracle(model).forward(tokens).logits.double().numpy()
    tol = TOLERANCE.get(wtype, TOLERANCE_QUANTIZED)
    bufts = ridgefill_cpp.build_info()["cpu_extra_buffer_types"]

    errors = {}
    for extra in (True, False):
        report, got = _prompt(model, extra, tokens, tmp_path)
        err = _rel(got, ref)
        err_one_row = _rel(got[-1:], ref[-1:])
        top1 = float((got.argmax(-1) == ref.argmax(-1)).mean())
        errors[extra] = (err, err_one_row, top1, report["weight_buffers"])
        assert err <= tol and err_one_row <= tol, (wtype, extra, errors[extra])
        assert top1 >= 0.95, (wtype, extra, errors[extra])
        if not extra:
            assert set(report["weight_buffers"]) <= {"CPU", "CPU_Mapped"}, report
        elif "AMX" in bufts and wtype in AMX_TYPES:
            assert "AMX" in report["weight_buffers"], (wtype, report)  # the tile kernels ran
    record_property(f"{wtype} rel err (extra buffers on, off)", (errors[True][0], errors[False][0]))
    record_property(f"{wtype} weight buffers", errors[True][3])
    print(f"\n{wtype}: {errors}")


# --------------------------------------------------------------------------------------------
# the AMX tile configuration in the machine code


#: the config ggml's AMX kernels use (ggml-cpu/amx/mmq.cpp): palette 1; tiles 0-1 B (8 x 64 bytes),
#: 2-3 A (16 x 32), 4-7 C (16 x 64)
EXPECTED_TILE_CONFIG = bytes([1, 0] + [0] * 14) + struct.pack("<16H", 64, 64, 32, 32, 64, 64, 64, 64, *[0] * 8) \
    + bytes([8, 8, 16, 16, 16, 16, 16, 16] + [0] * 8)
assert len(EXPECTED_TILE_CONFIG) == 64

_AMX_FLAGS = ["-march=sapphirerapids", "-O3", "-DNDEBUG", "-fPIC", "-std=gnu++17", "-fopenmp", "-DGGML_USE_OPENMP",
              "-D_GNU_SOURCE", "-D_XOPEN_SOURCE=600"]


def _compile_amx_kernels(tree: Path, obj: Path, cxx: str) -> None:
    src = tree / "ggml" / "src"
    cmd = [cxx, *_AMX_FLAGS, f"-I{src}", f"-I{src / 'ggml-cpu'}", f"-I{tree / 'ggml' / 'include'}",
           "-c", str(src / "ggml-cpu" / "amx" / "mmq.cpp"), "-o", str(obj)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]


def _section_bytes(obj: Path, section: str) -> bytes:
    with tempfile.NamedTemporaryFile(suffix=".bin") as f:
        subprocess.run(["objcopy", "-O", "binary", f"--only-section={section}", str(obj), f.name], check=True)
        return Path(f.name).read_bytes()


def _symbols(obj: Path) -> dict[str, tuple[str, int]]:
    """symbol -> (section, value) from the object's symbol table."""
    out = {}
    for line in subprocess.run(["objdump", "-t", str(obj)], capture_output=True, text=True, check=True).stdout.splitlines():
        parts = line.split()
        if len(parts) >= 5 and re.fullmatch(r"[0-9a-f]{16}", parts[0]):
            out[parts[-1]] = (parts[-3], int(parts[0], 16))
    return out


def tile_config_loads(obj: Path) -> list[dict]:
    """Each ``ldtilecfg`` in `obj`: where its operand lies, the 64 bytes it loads when they are static
    data, and whether the instructions just before it ask the kernel for the tile data state
    (arch_prctl(ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 0x12))."""
    dump = subprocess.run(["objdump", "-d", "-r", "--no-show-raw-insn", str(obj)], capture_output=True, text=True,
                          check=True).stdout.splitlines()
    symbols = _symbols(obj)
    loads = []
    for i, line in enumerate(dump):
        if "\tldtilecfg" not in line:
            continue
        operand = line.split("ldtilecfg", 1)[1].split("#")[0].strip()
        before = "\n".join(dump[max(0, i - 24):i])
        entry = {"operand": operand, "config": None,
                 "requests_tile_data": "$0x1023" in before and "syscall" in before}
        if operand.endswith("(%rip)"):
            m = re.search(r"R_X86_64_PC32\s+(\S+?)([+-]0x[0-9a-f]+)?$", dump[i + 1].strip())
            assert m, dump[i:i + 2]
            name, addend = m.group(1), int(m.group(2) or "0", 16)
            section, value = symbols.get(name, (name, 0))
            start = value + addend + 4  # the displacement is the instruction's last 4 bytes
            entry["config"] = _section_bytes(obj, section)[start:start + 64]
            entry["section"] = section
        loads.append(entry)
    return loads


@pytest.fixture(scope="module")
def amx_objects(tmp_path_factory) -> dict[str, Path]:
    """ggml's AMX kernels compiled for an AMX CPU, from the pinned source as published and with
    this project's patches applied, by the compiler the native build uses."""
    import platform

    import fetch_llama_cpp

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip(f"the AMX kernels are x86-64 code; this machine is {platform.machine()}")
    cxx = shutil.which("c++") or shutil.which("g++")
    assert cxx and shutil.which("objdump") and shutil.which("objcopy"), "a C++ compiler and binutils are needed"
    if "GNU" not in ridgefill_cpp.build_info()["compiler"]:
        pytest.skip("the native build's compiler is not GCC, whose _tile_loadconfig this checks")

    root = tmp_path_factory.mktemp("amx")
    pin = json.loads(fetch_llama_cpp.PIN_FILE.read_text())
    sdist = fetch_llama_cpp.fetch_sdist(pin, fetch_llama_cpp.default_cache_dir())
    pristine = fetch_llama_cpp.unpack_llama_cpp(sdist, pin, root / "pristine")
    patched = root / "patched"
    shutil.copytree(pristine, patched)
    fetch_llama_cpp.apply_patches(patched, fetch_llama_cpp.patch_files())
    objs = {"pristine": root / "pristine.o", "patched": root / "patched.o"}
    for name, tree in (("pristine", pristine), ("patched", patched)):
        _compile_amx_kernels(tree, objs[name], cxx)
    return objs


def test_amx_tile_config_reaches_ldtilecfg_whole(amx_objects):
    loads = tile_config_loads(amx_objects["patched"])
    assert loads, "no ldtilecfg in the AMX kernels: the check would prove nothing"
    for load in loads:
        assert load["config"] == EXPECTED_TILE_CONFIG, load  # constant data, every tile shape in it
        assert load["section"].startswith(".rodata"), load
        assert load["requests_tile_data"], load  # each thread asks for the tile state before its first config


def test_amx_tile_config_check_fails_on_the_unpatched_source(amx_objects):
    """The same check on the pinned source without patches/0008: its config is built on the stack
    (and GCC 12 stores only the palette byte there), so the check must reject it."""
    loads = tile_config_loads(amx_objects["pristine"])
    assert loads
    assert any(load["config"] != EXPECTED_TILE_CONFIG for load in loads), loads
