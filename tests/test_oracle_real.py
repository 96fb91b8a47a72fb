"""The exact-forward oracle against llama.cpp on the real models.

On F32 copies of the models (every tensor dequantized) llama.cpp and the oracle see the same
weights, and they agree tightly. On the quantized files llama.cpp multiplies quantized weights with activations it quantizes to 8 bits; the oracle uses
the dequantized weights in float32. So agreement is "within quantisation noise": top-1 agreement
of next-token predictions over every prompt row, and the mean KL divergence between the two
next-token distributions. The figures are printed (``pytest -s``) and recorded in the test report.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ridgefill_cpp.fitting.capture import capture_layer_inputs
from ridgefill_cpp.oracle import load_oracle

# public-domain text (the US Declaration of Independence, 1776), enough for ~150 tokens
TEXT = (
    "When in the Course of human events, it becomes necessary for one people to dissolve the political "
    "bands which have connected them with another, and to assume among the powers of the earth, the "
    "separate and equal station to which the Laws of Nature and of Nature's God entitle them, a decent "
    "respect to the opinions of mankind requires that they should declare the causes which impel them "
    "to the separation. We hold these truths to be self-evident, that all men are created equal, that "
    "they are endowed by their Creator with certain unalienable Rights, that among these are Life, "
    "Liberty and the pursuit of Happiness."
)


def _prompt_tokens(path) -> list[int]:
    from ridgefill_cpp.fitting.capture import open_model

    llm = open_model(path, n_ctx=512, n_batch=512)
    try:
        return llm.tokenize(TEXT.encode())
    finally:
        llm.close()


def _agreement(path, record_property, name, min_top1, max_kl):
    tokens = _prompt_tokens(path)
    cap = capture_layer_inputs(path, tokens, all_logits=True)
    out = load_oracle(path).forward(tokens)
    ref = out.logits.to(torch.float64)
    got = torch.from_numpy(cap.all_logits).to(torch.float64)
    top1 = (ref.argmax(-1) == got.argmax(-1)).double().mean().item()
    lp_ref = torch.log_softmax(ref, -1)
    lp_got = torch.log_softmax(got, -1)
    kl = (lp_got.exp() * (lp_got - lp_ref)).sum(-1)  # KL(llama.cpp || oracle) per row
    rel = [
        float(np.linalg.norm(cap.layer_inputs[il] - out.layer_inputs[il].numpy()) / np.linalg.norm(out.layer_inputs[il].numpy()))
        for il in range(cap.layer_inputs.shape[0])
    ]
    figures = {"n_tokens": len(tokens), "top1_agreement": top1, "kl_mean": kl.mean().item(),
               "kl_max": kl.max().item(), "layer_input_rel_err_max": max(rel)}
    print(f"\n{name}: {figures}")
    for k, v in figures.items():
        record_property(k, v)
    assert top1 >= min_top1, figures
    assert kl.mean().item() <= max_kl, figures
    assert max(rel) < 0.1, figures  # every layer's hidden state tracks the oracle


@pytest.mark.slow
def test_oracle_matches_llama_cpp_on_smollm2(smollm2_path, record_property):
    # Q4_1 weights with Q8_1 activations: measured top-1 0.967, mean KL 0.011 (123 rows)
    _agreement(smollm2_path, record_property, "smollm2-135m Q4_1", min_top1=0.95, max_kl=0.02)


@pytest.mark.slow
def test_oracle_matches_llama_cpp_on_gemma3(gemma3_path, record_property):
    # Q4_K/Q6_K weights with Q8_K activations: measured top-1 0.935, mean KL 0.030 (124 rows)
    _agreement(gemma3_path, record_property, "gemma3-270m Q4_K_M", min_top1=0.90, max_kl=0.05)


@pytest.fixture(scope="module", params=["smollm2-135m", "gemma3-270m"])
def f32_copy(request, tmp_path_factory):
    from ridgefill_cpp.maps.gguf_copy import dequantize_gguf

    from ridgefill_cpp.core import models

    import shutil

    from ridgefill_cpp.core.gguf_model import read_model_info

    src = models.available(request.param)
    if src is None:
        pytest.skip(f"{request.param} is not installed (`make models` installs it)")
    root = tmp_path_factory.mktemp("f32")
    need = 4 * read_model_info(src).n_params + (256 << 20)
    if shutil.disk_usage(root).free < need:
        pytest.skip(f"the F32 copy of {request.param} needs {need >> 20} MiB of free disk in {root}")
    dst = dequantize_gguf(src, root / f"{request.param}-f32.gguf")
    yield request.param, dst
    dst.unlink()


@pytest.mark.slow
def test_oracle_matches_llama_cpp_on_f32_copies_of_the_real_models(f32_copy, record_property):
    """Same weights on both sides: every layer input within 2e-4 of its scale, same top-1 everywhere.

    Measured (float64 oracle, 123-124 rows, flash attention off): Gemma 3 270M layer inputs
    <= 8.3e-5 of their max, KL 1.7e-6, top-1 100%.
    """
    name, path = f32_copy
    tokens = _prompt_tokens(path)
    cap = capture_layer_inputs(path, tokens, all_logits=True, flash_attn=False)
    out = load_oracle(path, dtype=torch.float64).forward(tokens)
    ref, got = out.logits, torch.from_numpy(cap.all_logits).to(torch.float64)
    lp_ref, lp_got = torch.log_softmax(ref, -1), torch.log_softmax(got, -1)
    kl = (lp_got.exp() * (lp_got - lp_ref)).sum(-1)
    err = [float(np.abs(cap.layer_inputs[il] - out.layer_inputs[il].numpy()).max() / np.abs(out.layer_inputs[il].numpy()).max())
           for il in range(cap.layer_inputs.shape[0])]
    top1 = (ref.argmax(-1) == got.argmax(-1)).double().mean().item()
    figures = {"layer_input_err_max": max(err), "kl_mean": kl.mean().item(), "top1_agreement": top1}
    print(f"\n{name} F32: {figures}")
    for k, v in figures.items():
        record_property(k, v)
    assert max(err) < 2e-4, figures
    assert kl.mean().item() < 1e-4, figures
    assert top1 == 1.0, figures
