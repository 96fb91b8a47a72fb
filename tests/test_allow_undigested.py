"""LLAMA_RIDGEFILL_ALLOW_UNDIGESTED=1 (issue #56, item 5): a map file without a content digest loads,
and is said to have loaded unchecked - once per loaded file, whatever ``verbose`` is - by ``Llama``
(an :class:`UndigestedMapsWarning`) and the commands (a ``warning:`` line on stderr); ``info`` says
libllama loads it only because the variable is set, not that libllama refuses it."""

from __future__ import annotations

import re
import warnings

import pytest

from ridgefill_cpp import Llama, RidgeFill, UndigestedMapsWarning
from ridgefill_cpp.fitting import corpus
from ridgefill_cpp.fitting.fit import FitOptions, fit_ridge_maps
from ridgefill_cpp.maps.mapfile import MapFileError, write_map_file
from ridgefill_cpp.testing.synthetic_maps import without_digest

SAID = ("the map file has no content digest (ridgefill.digest.xxh64) and was loaded only because "
        "LLAMA_RIDGEFILL_ALLOW_UNDIGESTED is set: corrupted map weights in it would not be detected")


@pytest.fixture(scope="module")
def fitted(tiny_models, tmp_path_factory):
    """A map file of the tiny llama model (with its content digest)."""
    fit = fit_ridge_maps(tiny_models["llama"], corpus.default_documents("calibration"),
                         FitOptions(n_tokens=2000, ctx=128, split=4, n_threads=1))
    return write_map_file(tmp_path_factory.mktemp("undigested") / "maps.gguf", fit.maps)


@pytest.fixture
def maps(tiny_models, fitted, tmp_path):
    """(the tiny llama model, a map file of it with a digest, the same file without one)."""
    return tiny_models["llama"], fitted, without_digest(fitted, tmp_path / "old.gguf")


@pytest.mark.parametrize("verbose", [False, True])
def test_llama_warns_once_per_undigested_file_it_loads(maps, monkeypatch, verbose):
    model, digested, old = maps
    monkeypatch.setenv("LLAMA_RIDGEFILL_ALLOW_UNDIGESTED", "1")
    with pytest.warns(UndigestedMapsWarning) as said:
        llm = Llama(str(model), n_ctx=256, verbose=verbose, ridgefill=RidgeFill(old, min_prompt=8))
    try:
        assert llm._rf_maps.digest_checked is False
        assert len(said) == 1 and str(said[0].message) == f"{old}: {SAID} (`ridgefill-gguf digest FILE` adds one " \
                                                           "to a file whose bytes you trust)"
        assert said[0].filename == __file__  # the caller's line, not the package's
        with warnings.catch_warnings():
            warnings.simplefilter("error", UndigestedMapsWarning)
            llm.set_ridgefill(RidgeFill(digested, min_prompt=8))  # checked: nothing to say
            assert llm._rf_maps.digest_checked is True
            llm.set_ridgefill(RidgeFill(old, min_prompt=8))  # loaded once per context: said once
            assert llm._rf_maps.digest_checked is False
    finally:
        llm.close()


def test_bench_says_it_loaded_an_undigested_file_unchecked(maps, cli, monkeypatch):
    model, _, old = maps
    monkeypatch.setenv("LLAMA_RIDGEFILL_ALLOW_UNDIGESTED", "1")
    r = cli("bench", model, "--maps", old, "--lengths", "64", "--repeats", 1, "--threads", 1, "--min-prompt", 0,
            "--tail", 8, "--greedy-tokens", 2, "--no-identity")
    said = " ".join(r.output.split())
    assert r.exit_code == 0, r.output
    assert said.count(f"warning: {old}: {SAID}") == 1, r.output
    assert "UndigestedMapsWarning" not in said  # a line of the command, not Python's warning format


def test_info_says_libllama_loads_an_undigested_file_only_with_the_variable(maps, cli, monkeypatch):
    """info says what libllama does with the file under the variable's value as libllama reads it
    (C atoi > 0), and libllama does that."""
    model, _, old = maps
    refuses = "corrupted weights cannot be detected, so libllama refuses the file; `ridgefill-gguf digest FILE` adds one"
    loads = ("corrupted weights cannot be detected, and libllama loads the file only because "
             "LLAMA_RIDGEFILL_ALLOW_UNDIGESTED is set; `ridgefill-gguf digest FILE` adds one")
    for value, loaded in ((None, False), ("0", False), ("yes", False), ("", False), ("1", True), (" 2", True)):
        if value is None:
            monkeypatch.delenv("LLAMA_RIDGEFILL_ALLOW_UNDIGESTED", raising=False)
        else:
            monkeypatch.setenv("LLAMA_RIDGEFILL_ALLOW_UNDIGESTED", value)
        r = cli("info", old)
        said = " ".join(r.output.split())
        assert r.exit_code == 0, r.output
        assert (loads if loaded else refuses) in said and (refuses if loaded else loads) not in said, (value, said)
        if loaded:
            with pytest.warns(UndigestedMapsWarning):
                Llama(str(model), n_ctx=256, verbose=False, ridgefill=RidgeFill(old, min_prompt=8)).close()
        else:
            with pytest.raises(MapFileError, match=re.escape("has no content digest")):
                Llama(str(model), n_ctx=256, verbose=False, ridgefill=RidgeFill(old, min_prompt=8))
