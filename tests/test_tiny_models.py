"""The tiny test models (ridgefill_cpp/testing/tiny_models.py): metadata as intended, llama.cpp loads, tokenizes
and runs them, the output is deterministic and written atomically."""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import numpy as np
import pytest

from ridgefill_cpp.testing import tiny_models as mtm

from ridgefill_cpp.core.gguf_model import read_metadata, read_tensors

DENSE = ("llama", "qwen3", "gemma3")


def _sha(p: Path) -> str:
    return hashlib.sha256(Path(p).read_bytes()).hexdigest()


def _vocab_only(path: Path):
    from llama_cpp import Llama

    return Llama(model_path=str(path), vocab_only=True, verbose=False)


# ------------------------------------------------------------------------------------------------
# the files


@pytest.mark.parametrize("arch", mtm.ARCHS)
def test_architecture_and_tokenizer_keys(tiny_models, arch):
    import gguf

    md = {k: f.contents() for k, f in gguf.GGUFReader(tiny_models[arch]).fields.items()}
    pieces, scores, types = mtm.tokenizer_vocab()
    assert md["general.architecture"] == arch
    assert md["tokenizer.ggml.model"] == "llama"
    assert md["tokenizer.ggml.tokens"] == pieces
    assert md["tokenizer.ggml.token_type"] == types
    assert np.allclose(md["tokenizer.ggml.scores"], scores)
    assert (md["tokenizer.ggml.unknown_token_id"], md["tokenizer.ggml.bos_token_id"],
            md["tokenizer.ggml.eos_token_id"]) == (0, 1, 2)
    assert 300 <= len(pieces) <= 512
    assert pieces[3:259] == [f"<0x{b:02X}>" for b in range(256)]
    assert len(set(pieces)) == len(pieces)


@pytest.mark.parametrize("arch", DENSE)
def test_dense_hyperparameters_and_shapes(tiny_models, arch):
    cfg = mtm.tiny_config(arch)
    md = read_metadata(tiny_models[arch])
    t = read_tensors(tiny_models[arch])
    assert md[f"{arch}.block_count"] == cfg.n_layer
    assert md[f"{arch}.embedding_length"] == cfg.n_embd == 64
    assert (md[f"{arch}.attention.head_count"], md[f"{arch}.attention.head_count_kv"]) == (4, 2)  # GQA
    assert md[f"{arch}.attention.key_length"] == md[f"{arch}.rope.dimension_count"] == 16
    assert md[f"{arch}.context_length"] == 2048
    n_vocab = len(mtm.tokenizer_vocab()[0])
    assert t["token_embd.weight"].shape == (n_vocab, 64)
    assert t["blk.0.attn_q.weight"].shape == (64, 64)
    assert t["blk.0.attn_k.weight"].shape == t["blk.0.attn_v.weight"].shape == (32, 64)
    assert t["blk.0.ffn_up.weight"].shape == (128, 64) and t["blk.0.ffn_down.weight"].shape == (64, 128)
    # the paths each architecture is meant to exercise
    assert ("output.weight" in t) == (arch == "qwen3")  # llama and gemma3 tie the output head
    assert ("blk.0.attn_q.bias" in t) == (arch == "llama")
    assert ("blk.0.attn_k_norm.weight" in t) == (arch in ("qwen3", "gemma3"))
    assert ("blk.0.post_ffw_norm.weight" in t) == (arch == "gemma3")
    # weights O(1/sqrt(fan_in)), norms around 1
    assert 0.5 < t["blk.0.attn_q.weight"].std() * math.sqrt(64) < 1.5
    assert abs(t["blk.0.attn_norm.weight"].mean() - 1.0) < 0.1


def test_gemma3_has_sliding_and_full_layers(tiny_models):
    md = read_metadata(tiny_models["gemma3"])
    cfg = mtm.tiny_config("gemma3")
    assert md["gemma3.attention.sliding_window"] == 16
    assert md["gemma3.rope.freq_base_swa"] != md["gemma3.rope.freq_base"]
    assert md["gemma3.final_logit_softcapping"] > 0
    full = [il for il in range(cfg.n_layer) if not mtm.is_swa_layer(cfg, il)]
    assert full == [3, 7]


def test_deterministic_and_seeded(tmp_path):
    a = mtm.make_tiny_model("llama", tmp_path / "a" / "m.gguf", seed=3)
    b = mtm.make_tiny_model("llama", tmp_path / "b.gguf", seed=3)  # content independent of the path
    c = mtm.make_tiny_model("llama", tmp_path / "c.gguf", seed=4)
    assert _sha(a) == _sha(b) != _sha(c)


def test_overrides_and_f16(tmp_path):
    import gguf

    p = mtm.make_tiny_model("qwen3", tmp_path / "q.gguf", n_layer=2, dtype="f16", tied_embeddings=True)
    r = gguf.GGUFReader(p)
    types = {t.name: t.tensor_type for t in r.tensors}
    assert types["blk.1.attn_q.weight"] == gguf.GGMLQuantizationType.F16
    assert types["blk.1.attn_norm.weight"] == gguf.GGMLQuantizationType.F32
    assert "blk.2.attn_q.weight" not in types and "output.weight" not in types


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="supported: llama, qwen3, gemma3, qwen35"):
        mtm.make_tiny_model("gpt2", tmp_path / "x.gguf")
    with pytest.raises(TypeError, match="n_layers"):
        mtm.make_tiny_model("llama", tmp_path / "x.gguf", n_layers=3)
    with pytest.raises(ValueError, match="multiple of n_head_kv"):
        mtm.make_tiny_model("llama", tmp_path / "x.gguf", n_head_kv=3)
    with pytest.raises(ValueError, match="gemma3 options"):
        mtm.make_tiny_model("qwen3", tmp_path / "x.gguf", sliding_window=16)
    assert list(tmp_path.iterdir()) == []


def test_write_is_atomic(tmp_path, monkeypatch):
    """A failure while writing leaves neither the target nor a temporary file behind, and an
    existing file at the target is untouched."""
    target = mtm.make_tiny_model("llama", tmp_path / "m.gguf", n_layer=1)
    before = _sha(target)

    def boom(self, *a, **k):
        raise OSError("disk full")

    import gguf

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", boom)
    with pytest.raises(OSError, match="disk full"):
        mtm.make_tiny_model("llama", target, n_layer=2)
    assert _sha(target) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]


def test_script_entry_point(tmp_path, capsys):
    assert mtm.main([str(tmp_path), "--arch", "llama", "--arch", "gemma3", "--dtype", "f16"]) == 0
    out = capsys.readouterr().out.split()
    assert out == [str(tmp_path / "llama.gguf"), str(tmp_path / "gemma3.gguf")]
    assert read_metadata(tmp_path / "gemma3.gguf")["general.file_type"] == 1


# ------------------------------------------------------------------------------------------------
# llama.cpp


def test_llama_cpp_tokenizes_any_text(tiny_models):
    llm = _vocab_only(tiny_models["llama"])
    try:
        pieces = mtm.tokenizer_vocab()[0]
        ids = llm.tokenize(b"the cat sat on the mat", add_bos=True)
        assert [pieces[i] for i in ids] == ["<s>", "\u2581the", "\u2581c", "at", "\u2581s", "at", "\u2581on",
                                            "\u2581the", "\u2581m", "at"]
        text = "Grüße, 世界! 123\nnew  line\ttab"
        ids = llm.tokenize(text.encode(), add_bos=True)
        assert ids[0] == 1 and 0 not in ids  # no <unk>: byte fallback covers everything
        assert any(pieces[i].startswith("<0x") for i in ids)
        assert llm.detokenize(ids).decode() == text
    finally:
        llm.close()


@pytest.mark.parametrize("arch", mtm.ARCHS)
def test_llama_cpp_loads_and_runs(tiny_models, arch):
    import ridgefill_cpp  # noqa: F401  (the patched libraries)
    from llama_cpp import Llama
    from llama_cpp import llama_cpp as C

    md = read_metadata(tiny_models[arch])
    llm = Llama(model_path=str(tiny_models[arch]), n_ctx=256, n_batch=128, verbose=False, logits_all=False)
    try:
        model = llm._model.model
        assert C.llama_model_n_layer(model) == md[f"{arch}.block_count"]
        assert C.llama_model_n_embd(model) == md[f"{arch}.embedding_length"]
        assert llm.n_vocab() == len(mtm.tokenizer_vocab()[0])
        ids = llm.tokenize(("the day was long and we did get some water " * 6).encode(), add_bos=True)
        assert len(ids) > 40
        llm.eval(ids)
        ptr = C.llama_get_logits_ith(llm._ctx.ctx, -1)
        logits = np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),)).astype(np.float64)
        assert np.isfinite(logits).all()
        # not degenerate: a spread of a few units, no single token dominating by construction
        assert 0.3 < logits.std() < 20.0
    finally:
        llm.close()
