"""The command line and the server on a tiny model of each architecture added after the first four
(qwen2, mistral3, qwen3moe, qwen35moe, gpt-oss): ``info`` says it is supported, ``fit`` writes maps
from llama.cpp's hidden states, ``bench``, ``eval`` and ``tune`` run with them, and ``serve`` answers
a planned prompt with RidgeFill applied and the same first-token distribution and greedy tokens as
the library. Agreement with the oracle is in test_prefill.py / test_prefill_qwen35.py; this is the
user-facing path of each architecture end to end.
"""

from __future__ import annotations

import json
import shutil

import pytest

from ridgefill_cpp import RidgeFill  # first: the patched libraries
from ridgefill_cpp.core.gguf_model import read_model_info
from ridgefill_cpp.maps.mapfile import read_map_file
from ridgefill_cpp.server.serve import Server
from test_serve import no_proxy  # noqa: F401  (autouse: loopback requests never go through a proxy)
from test_serve_ridgefill import TINY_ARGS, _assert_same, _complete, _library, _prompt

NEW = ("qwen2", "mistral3", "qwen3moe", "qwen35moe", "gpt-oss")
SPLIT = 3
# the retrieval check is off: its question does not fit these tails (eval --quick runs retrieval on every arch)
TUNE_GRID = ("--tails", "8,16", "--fractions", "0,0.5", "--length", 256, "--docs", 2, "--threads", 1, "--retrieval-prompts", 0)


@pytest.fixture(scope="module", params=NEW)
def arch(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def fitted(arch, tiny_models, tmp_path_factory):
    """(model, map file): maps fitted by ``ridgefill-gguf fit`` on a copy of the tiny model."""
    from typer.testing import CliRunner

    from ridgefill_cpp.cli import app

    root = tmp_path_factory.mktemp(f"cli-{arch}")
    model = root / f"tiny-{arch}.gguf"
    shutil.copy(tiny_models[arch], model)
    maps = root / f"tiny-{arch}.ridgefill.gguf"
    res = CliRunner().invoke(app, ["fit", str(model), "--tokens", "3000", "--ctx", "128", "--split", str(SPLIT),
                                   "--threads", "1", "-o", str(maps)])
    assert res.exit_code == 0, res.output
    return model, maps


def test_info_and_fit(arch, fitted, cli):
    model, maps = fitted
    info = read_model_info(model)
    assert info.architecture == arch and info.supported
    res = cli("info", model)
    assert res.exit_code == 0 and "yes" in res.output, res.output
    m = read_map_file(maps)
    assert (m.meta.architecture, m.meta.split_layer, m.meta.n_layer) == (arch, SPLIT, info.n_layer)
    assert m.meta.layers == list(range(SPLIT + 1, info.n_layer))  # layer S fills from x_S itself
    res = cli("info", maps, "--model", model)
    assert res.exit_code == 0, res.output


def test_bench_eval_and_tune(arch, fitted, cli, tmp_path):
    model, maps = fitted
    out = tmp_path / "bench.json"
    res = cli("bench", model, "--maps", maps, "--lengths", "200", "--repeats", 1, "--threads", 1, "--min-prompt", 0,
              "--tail", 16, "--greedy-tokens", 4, "--json", out)
    assert res.exit_code == 0, res.output
    rows = json.loads(out.read_text())
    assert "ridge" in json.dumps(rows) and "stock" in json.dumps(rows)

    res = cli("eval", model, "--maps", maps, "--quick", "--docs", 2, "--threads", 1, "--out", tmp_path / "eval")
    assert res.exit_code == 0, res.output
    summary = json.loads((tmp_path / "eval" / "results.json").read_text())["summary"]
    assert all({"ridge", "identity"} <= set(s) for s in summary.values())

    res = cli("tune", model, "--maps", maps, "--budget", 10, *TUNE_GRID, "--dry-run", "--json")
    assert res.exit_code == 0, res.output
    d = json.loads(res.stdout)
    assert d["error"] is None and d["written"] is None and len(d["points"]) >= 4
    assert d["defaults"]["tail"] == d["points"][d["chosen"]]["tail"]


def test_serve_applies_ridgefill(arch, fitted, tmp_path):
    model, maps = fitted
    rf = RidgeFill(maps, tail=16, exact_fraction=0.1, selector="attention", min_prompt=64)
    prompt = _prompt(model, 300, shift=7)  # a prompt whose first greedy token is a whole UTF-8 piece on each
    with Server(model, rf, extra_args=TINY_ARGS, log_path=tmp_path / "server.log", startup_timeout=60) as s:
        res = _complete(s, prompt)
    st = res["ridgefill"]
    assert st["applied"] and (st["split"], st["n_prompt"], st["tail"]) == (SPLIT, 300, 16)
    assert st["n_filled"] == 300 - 16 - st["n_exact"] > 0
    _assert_same(res, _library(model, prompt, rf))
