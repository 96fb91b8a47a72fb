"""``ridgefill-gguf info`` on model GGUFs, and its errors for bad files."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from ridgefill_cpp.core.gguf_model import GGUFFileError, read_model_info


def _digest(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3", "qwen35"])
def test_info_on_tiny_models(cli, tiny_models, arch):
    import gguf

    path = tiny_models[arch]
    res = cli("info", "--json", path)
    assert res.exit_code == 0, res.output
    got = json.loads(res.output)
    # cross-check against the raw GGUF keys
    r = gguf.GGUFReader(path)
    kv = {k: f.contents() for k, f in r.fields.items() if not k.startswith("tokenizer.")}
    L = kv[f"{arch}.block_count"]
    assert got["architecture"] == arch
    assert got["n_layer"] == L
    assert got["n_embd"] == kv[f"{arch}.embedding_length"]
    assert got["context_length"] == kv[f"{arch}.context_length"]
    assert got["default_split"] == L - L // 3
    assert got["supported"] is True
    assert got["qk_norm"] == (arch in ("qwen3", "gemma3", "qwen35"))
    if arch == "gemma3":
        assert got["sliding_window"] == kv["gemma3.attention.sliding_window"] > 0
        assert 0 < len(got["swa_layers"]) < L
    else:
        assert got["swa_layers"] == []
    if arch == "qwen35":
        assert 0 < len(got["recurrent_layers"]) < L
    res = cli("info", path)
    assert res.exit_code == 0 and "default split S" in res.output


def test_info_smollm2(cli, smollm2_path):
    mi = read_model_info(smollm2_path)
    assert (mi.architecture, mi.n_layer, mi.n_embd, mi.n_head, mi.n_head_kv, mi.head_dim) == ("llama", 30, 576, 9, 3, 64)
    assert (mi.qk_norm, mi.sliding_window, mi.context_length, mi.default_split) == (False, 0, 8192, 20)
    assert mi.supported and mi.file_type == "Q4_1"
    res = cli("info", smollm2_path)
    assert res.exit_code == 0 and "Q4_1" in res.output


def test_info_gemma3(cli, gemma3_path):
    mi = read_model_info(gemma3_path)
    assert (mi.architecture, mi.n_layer, mi.n_embd, mi.n_head, mi.n_head_kv, mi.head_dim) == ("gemma3", 18, 640, 4, 1, 256)
    assert mi.qk_norm and mi.sliding_window == 512 and mi.default_split == 12
    # pattern 6: layers 5, 11, 17 are full attention
    assert [il for il in range(18) if il not in mi.swa_layers] == [5, 11, 17]
    assert mi.context_length == 32768 and mi.supported
    res = cli("info", gemma3_path)
    assert res.exit_code == 0 and "gemma3" in res.output


def test_info_missing_file(cli, tmp_path):
    res = cli("info", tmp_path / "nope.gguf")
    assert res.exit_code == 1
    assert "no such file" in res.output


def test_info_non_gguf_file(cli, tmp_path):
    p = tmp_path / "model.gguf"
    p.write_text("this is not a model\n" * 10)
    before = _digest(p)
    res = cli("info", p)
    assert res.exit_code == 1
    assert "not a GGUF file" in res.output
    assert _digest(p) == before


@pytest.mark.parametrize("keep", [0.5, 0.02])
def test_info_truncated_file(cli, tiny_models, tmp_path, keep):
    src = tiny_models["llama"]
    data = src.read_bytes()
    p = tmp_path / "cut.gguf"
    p.write_bytes(data[: int(len(data) * keep)])
    res = cli("info", p)
    assert res.exit_code == 1
    assert "truncated" in res.output
    with pytest.raises(GGUFFileError, match="truncated"):
        read_model_info(p)
    assert src.read_bytes() == data


def test_info_empty_file(cli, tmp_path):
    p = tmp_path / "empty.gguf"
    p.write_bytes(b"")
    res = cli("info", p)
    assert res.exit_code == 1 and "not a GGUF file" in res.output


def test_info_says_when_an_architecture_is_unsupported(cli, unsupported_model):
    res = cli("info", unsupported_model)
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())  # the table wraps long values
    assert "no (supported: llama, qwen3, gemma3, qwen35, qwen2, mistral3, qwen3moe, qwen35moe, gpt-oss)" in text
    assert read_model_info(unsupported_model).supported is False
