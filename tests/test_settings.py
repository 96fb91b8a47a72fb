"""The settings vocabulary (ridgefill_cpp.core.settings) against the C header, its grammar and checks, and
the plan driver of the Python class: ``Llama.prefill``, ``Llama.set_ridgefill``."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from conftest import evaluation_tokens
from prefill_helpers import ctx_kwargs, last_logits

import llama_cpp  # noqa: E402  (after ridgefill_cpp, which prefill_helpers imports first)
from ridgefill_cpp import Llama, RidgeFill
from ridgefill_cpp.core import settings
from ridgefill_cpp.oracle import fill as F

HEADER = Path(__file__).resolve().parent.parent / "csrc" / "llama-ridgefill.h"
N_TOKENS, TAIL, SPLIT = 160, 16, 3


def _enum(prefix: str) -> dict[str, int]:
    text = HEADER.read_text()
    return {m.group(1): int(m.group(2)) for m in re.finditer(rf"\b{prefix}(\w+)\s*=\s*(\d+)", text)}


def test_the_tables_carry_the_c_enum_values():
    selectors = _enum("LLAMA_RIDGEFILL_SELECTOR_")
    assert {name.upper().replace("+", "_"): v for name, v in settings.SELECTORS.items()} == selectors
    classes = _enum("LLAMA_RIDGEFILL_CLASS_")
    assert {"sink": classes["SINK"], "digits": classes["DIGIT"], "rare": classes["RARE"],
            "line_start": classes["LINE_START"]} == dict(settings.TOKEN_CLASSES)
    splices = _enum("LLAMA_RIDGEFILL_SPLICE_")
    assert {(k or "NONE"): v for k, v in settings.SPLICES.items()} == splices
    corrections = _enum("LLAMA_RIDGEFILL_STATE_CORRECTION_")
    assert {(k or "none").upper(): v for k, v in settings.STATE_CORRECTIONS.items()} == corrections
    # the constants of the span and recency rules: the header's, the settings' and the oracle's
    defines = {m.group(1): float(m.group(2)) for m in re.finditer(r"#define LLAMA_RIDGEFILL_(\w+)\s+([\d.]+)", HEADER.read_text())}
    assert (defines["MAX_SPAN"], defines["SPAN_SHARE"]) == (settings.MAX_SPAN, settings.SPAN_SHARE) == (4096, F.SPAN_SHARE)
    assert (defines["RECENCY_SHARE"], defines["RECENCY_MAX_SLOPE"]) == (settings.RECENCY_SHARE, F.RECENCY_MAX_SLOPE)
    assert settings.RECENCY_SHARE == F.RECENCY_SHARE


def test_selector_grammar_and_checks():
    assert settings.parse_selector("probe") == {"selector": "probe"}
    assert settings.parse_selector("protected:digits+rare") == {"selector": "protected", "protected": ("digits", "rare")}
    assert settings.parse_selector("attention+protected:sink") == {"selector": "attention+protected",
                                                                   "protected": ("sink",)}
    assert settings.parse_selector("attention@16") == {"selector": "attention", "span": 16}
    assert settings.parse_selector("attention+protected:digits@8") == {"selector": "attention+protected",
                                                                       "protected": ("digits",), "span": 8}
    for bad, msg in [("probing", "selector 'probing'"), ("probe:digits", "selector 'probe:digits'"),
                     ("protected:vowels", "protected token classes"), ("protected@4", "only attention"),
                     ("attention@", "span after @"), ("attention@x", "span after @"), ("attention@0", "must be >= 1"),
                     ("attention@4097", "must be <= 4096")]:
        with pytest.raises(ValueError, match=msg):
            settings.parse_selector(bad)
    assert settings.check("tail", 8) == 8 and settings.check("selector", [9, 3, 3]) == (3, 9)
    with pytest.raises(ValueError, match="tuned tail 0 must be >= 1"):
        settings.check("tail", 0, label="tuned tail")
    with pytest.raises(ValueError, match="splice 'Q'"):
        settings.check("splice", "Q")


def test_resolve_tunable_is_libllamas_resolution(tmp_path):
    """An argument, else the map file's tuned value, else the built-in one: resolved in libllama
    (llama_ridgefill_resolve_params), with the fields the file gave reported."""
    import gguf

    from ridgefill_cpp.maps.mapfile import TUNED_PREFIX, rewrite_map_file, write_map_file
    from test_mapfile import _maps

    synthetic_maps = write_map_file(tmp_path / "maps.gguf", _maps(n_embd=64, split=3, n_layer=6), dtype="f32")
    path = rewrite_map_file(synthetic_maps, tmp_path / "tuned.gguf", add_keys=[
        (TUNED_PREFIX + "exact_fraction", 0.5, gguf.GGUFValueType.FLOAT64),
        (TUNED_PREFIX + "span", 4, gguf.GGUFValueType.UINT32)])
    values, origin = settings.resolve_tunable({"tail": 8, "exact_fraction": None, "selector": None}, path)
    assert values == {"tail": 8, "exact_fraction": 0.5, "selector": settings.SELECTOR, "span": 4,
                      "key_rescale": settings.KEY_RESCALE}
    assert origin == {"tail": "argument", "exact_fraction": "map file", "selector": "built-in", "span": "map file",
                      "key_rescale": "built-in"}
    values, origin = settings.resolve_tunable({}, None)
    assert values == settings.TUNABLE_DEFAULTS and set(origin.values()) == {"built-in"}
    bad = rewrite_map_file(synthetic_maps, tmp_path / "bad.gguf", add_keys=[
        (TUNED_PREFIX + "span", "4", gguf.GGUFValueType.STRING)])
    with pytest.raises(ValueError, match=r"metadata key ridgefill\.tuned\.span is not a uint32"):
        settings.resolve_tunable({}, bad)
    with pytest.raises(ValueError, match=r"ridgefill\.tuned\.span is not a uint32"):  # a file of the wrong type, given or not
        settings.resolve_tunable({"span": 2}, bad)


@pytest.fixture(scope="module")
def prompt(tiny_models) -> list[int]:
    return evaluation_tokens(tiny_models["llama"], N_TOKENS)


def test_prefill_returns_the_logits_of_the_last_rows(tiny_models, prompt):
    """Without RidgeFill, prefill(tokens, k) is llama-cpp-python's evaluation with the last k rows'
    logits kept: the rows of a logits_all context, and the same bookkeeping as eval."""
    path = str(tiny_models["llama"])
    every = llama_cpp.Llama(path, **ctx_kwargs(logits_all=True))
    llm = Llama(path, **ctx_kwargs())
    try:
        every.eval(prompt)
        got = llm.prefill(prompt, 5)
        assert got.shape == (5, llm.n_vocab()) and got.dtype == np.float32
        np.testing.assert_allclose(got, every.scores[N_TOKENS - 5:N_TOKENS], rtol=1e-5, atol=1e-5)
        assert llm.n_tokens == N_TOKENS and list(llm.input_ids[:N_TOKENS]) == prompt
        assert np.array_equal(got[-1], last_logits(llm))
        more = llm.prefill(prompt[:3], 1)  # continues after the tokens already in the context, as eval does
        assert llm.n_tokens == N_TOKENS + 3 and more.shape == (1, llm.n_vocab())
        for n_logits in (0, 4, 1.0):
            with pytest.raises(ValueError, match="n_logits"):
                llm.prefill(prompt[:3], n_logits)
    finally:
        every.close()
        llm.close()


def test_set_ridgefill_switches_the_plan_of_one_context(tiny_models, prompt):
    """A planned prefill reports the documented stat keys and gives the tail rows' logits (eval's last
    row among them); set_ridgefill(None) is stock prefill again, bit for bit, and back again plans."""
    path = str(tiny_models["llama"])
    stock = Llama(path, **ctx_kwargs())
    rf = RidgeFill.identity(SPLIT, tail=TAIL, min_prompt=0)
    llm = Llama(path, ridgefill=rf, **ctx_kwargs())
    try:
        stock.eval(prompt)
        llm.eval(prompt)
        planned = last_logits(llm)
        assert list(llm.ridgefill_stats) == list(settings.STATS) and llm.ridgefill_stats["n_filled"] > 0
        llm.reset()
        tail = llm.prefill(prompt, TAIL)
        assert np.isfinite(tail).all() and llm.ridgefill_stats["tail"] == TAIL
        np.testing.assert_allclose(tail[-1], planned, rtol=1e-5, atol=1e-5)

        llm.set_ridgefill(None)
        assert llm.ridgefill is None and llm.ridgefill_stats == {}
        llm.reset()
        llm.eval(prompt)
        assert llm.ridgefill_stats == {} and np.array_equal(last_logits(llm), last_logits(stock))

        other = RidgeFill.identity(SPLIT, tail=TAIL, min_prompt=0, exact_fraction=0.5)
        llm.set_ridgefill(other)
        llm.reset()
        llm.eval(prompt)
        assert llm.ridgefill is other and llm.ridgefill_stats["n_exact"] > 0
        with pytest.raises(ValueError, match=r"split 9 outside 1\.\.6"):  # libllama refuses it: RidgeFill is off
            llm.set_ridgefill(RidgeFill.identity(9, min_prompt=0))
        assert llm.ridgefill is None
        llm.reset()
        llm.eval(prompt)
        assert llm.ridgefill_stats == {} and np.array_equal(last_logits(llm), last_logits(stock))
    finally:
        stock.close()
        llm.close()
