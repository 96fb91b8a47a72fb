// The table of supported architectures (see llama-ridgefill-arch.h).

#include "llama-ridgefill-arch.h"
#include "llama-ridgefill.h"
#include "llama-ridgefill-graph.h"

#include "llama-graph.h"
#include "llama-impl.h"
#include "llama-model.h"

#include <algorithm>
#include <iterator>

//
// the K path after the projection, per architecture (as src/models/<arch>.cpp computes it)
//

static ggml_tensor * rf_rope(const llm_graph_context & g, ggml_tensor * k, ggml_tensor * pos, ggml_tensor * factors,
        float freq_base, float freq_scale) {
    return ggml_rope_ext(g.ctx0, k, pos, factors, g.n_rot, g.rope_type, g.n_ctx_orig, freq_base, freq_scale,
            g.ext_factor, g.attn_factor, g.beta_fast, g.beta_slow);
}

// llama: RoPE (with the model's rope factors), then the optional unweighted k-norm
static ggml_tensor * rf_k_llama(const llm_graph_context & g, int il, ggml_tensor * k, ggml_tensor * pos) {
    const llama_hparams & hparams = g.hparams;
    if (pos) {
        k = rf_rope(g, k, pos, g.rf->model->get_rope_factors(g.cparams, il), g.freq_base, g.freq_scale);
    }
    if (hparams.use_kq_norm) {
        k = ggml_rms_norm(g.ctx0, k, hparams.f_norm_rms_eps);
    }
    return k;
}

// qwen3: k-norm, then RoPE
static ggml_tensor * rf_k_qwen3(const llm_graph_context & g, int il, ggml_tensor * k, ggml_tensor * pos) {
    k = g.build_norm(k, g.rf->model->layers[il].attn_k_norm, nullptr, LLM_NORM_RMS, il);
    return pos ? rf_rope(g, k, pos, nullptr, g.freq_base, g.freq_scale) : k;
}

// qwen35: k-norm, then M-RoPE (pos holds the rows' positions section-major, 4 * n)
static ggml_tensor * rf_k_qwen35(const llm_graph_context & g, int il, ggml_tensor * k, ggml_tensor * pos) {
    const llama_hparams & hparams = g.hparams;
    k = g.build_norm(k, g.rf->model->layers[il].attn_k_norm, nullptr, LLM_NORM_RMS, il);
    if (pos) {
        int sections[4];
        std::copy(std::begin(hparams.rope_sections), std::begin(hparams.rope_sections) + 4, sections);
        k = ggml_rope_multi(g.ctx0, k, pos, nullptr, g.n_rot, sections, g.rope_type, g.n_ctx_orig, g.freq_base,
                g.freq_scale, g.ext_factor, g.attn_factor, g.beta_fast, g.beta_slow);
    }
    return k;
}

// gemma3: k-norm, then RoPE with the layer's own base and scale (local and global layers differ)
static ggml_tensor * rf_k_gemma3(const llm_graph_context & g, int il, ggml_tensor * k, ggml_tensor * pos) {
    const llama_hparams & hparams = g.hparams;
    k = g.build_norm(k, g.rf->model->layers[il].attn_k_norm, nullptr, LLM_NORM_RMS, il);
    if (pos) {
        const bool iswa = hparams.swa_type == LLAMA_SWA_TYPE_STANDARD;
        k = rf_rope(g, k, pos, nullptr,
                iswa ? g.rf->model->get_rope_freq_base (g.cparams, il) : g.freq_base,
                iswa ? g.rf->model->get_rope_freq_scale(g.cparams, il) : g.freq_scale);
    }
    return k;
}

// qwen2: RoPE only (its Q/K/V biases are part of the projections)
static ggml_tensor * rf_k_qwen2(const llm_graph_context & g, int il, ggml_tensor * k, ggml_tensor * pos) {
    GGML_UNUSED(il);
    return pos ? rf_rope(g, k, pos, nullptr, g.freq_base, g.freq_scale) : k;
}

// mistral3: RoPE with the model's rope factors (its attention temperature scales Q only)
static ggml_tensor * rf_k_mistral3(const llm_graph_context & g, int il, ggml_tensor * k, ggml_tensor * pos) {
    return pos ? rf_rope(g, k, pos, g.rf->model->get_rope_factors(g.cparams, il), g.freq_base, g.freq_scale) : k;
}

// gpt-oss: RoPE with the layer's own base and scale (sliding-window and full layers alternate); its
// attention sinks enter the softmax only
static ggml_tensor * rf_k_gpt_oss(const llm_graph_context & g, int il, ggml_tensor * k, ggml_tensor * pos) {
    const llama_model & model = *g.rf->model;
    return pos ? rf_rope(g, k, pos, nullptr, model.get_rope_freq_base(g.cparams, il), model.get_rope_freq_scale(g.cparams, il)) : k;
}

static const char * rf_refuse_moe(const llama_model & model) {
    return model.hparams.n_expert > 0 ? "mixture-of-experts llama models are not supported by RidgeFill prefill" : nullptr;
}

static const char * rf_refuse_none(const llama_model & model) {
    GGML_UNUSED(model);
    return nullptr;
}

//
// the table
//

static const llama_ridgefill_arch RF_ARCHS[] = {
    //  arch                 name         hybrid q_width k_path         refuse
    { LLM_ARCH_LLAMA,      "llama",     false, 1, rf_k_llama,    rf_refuse_moe  },
    { LLM_ARCH_QWEN3,      "qwen3",     false, 1, rf_k_qwen3,    rf_refuse_none },
    { LLM_ARCH_GEMMA3,     "gemma3",    false, 1, rf_k_gemma3,   rf_refuse_none },
    { LLM_ARCH_QWEN35,     "qwen35",    true,  2, rf_k_qwen35,   rf_refuse_none },
    { LLM_ARCH_QWEN2,      "qwen2",     false, 1, rf_k_qwen2,    rf_refuse_none },
    { LLM_ARCH_MISTRAL3,   "mistral3",  false, 1, rf_k_mistral3, rf_refuse_none },
    { LLM_ARCH_QWEN3MOE,   "qwen3moe",  false, 1, rf_k_qwen3,    rf_refuse_none },
    { LLM_ARCH_QWEN35MOE,  "qwen35moe", true,  2, rf_k_qwen35,   rf_refuse_none },
    { LLM_ARCH_OPENAI_MOE, "gpt-oss",   false, 1, rf_k_gpt_oss,  rf_refuse_none },
};

const llama_ridgefill_arch * llama_ridgefill_arch_find(llm_arch arch) {
    for (const auto & a : RF_ARCHS) {
        if (a.arch == arch) {
            return &a;
        }
    }
    return nullptr;
}

const llama_ridgefill_arch * llama_ridgefill_arch_at(int32_t i) {
    return i >= 0 && i < (int32_t) std::size(RF_ARCHS) ? &RF_ARCHS[i] : nullptr;
}

std::string llama_ridgefill_arch_list() {
    std::string res;
    for (const auto & a : RF_ARCHS) {
        res += res.empty() ? "" : ", ";
        res += a.name;
    }
    return res;
}

std::string llama_ridgefill_arch_check(const llama_model & model) {
    const llama_ridgefill_arch * a = llama_ridgefill_arch_find(model.arch);
    if (a == nullptr) {
        return format("architecture '%s' is not supported by RidgeFill prefill (supported: %s)",
                llm_arch_name(model.arch), llama_ridgefill_arch_list().c_str());
    }
    const char * why = a->refuse(model);
    return why ? why : "";
}

bool llama_ridgefill_is_full_attention(const llama_hparams & hparams, int32_t il) {
    return !hparams.is_swa(il) && !hparams.is_recr(il);
}

int32_t llama_ridgefill_default_sel_layer(const llama_hparams & hparams, int32_t split) {
    for (int32_t il = split - 1; il >= 0; --il) {
        if (llama_ridgefill_is_full_attention(hparams, il)) {
            return il;
        }
    }
    return -1;
}

//
// C API
//

const char * llama_ridgefill_supported_arch(int32_t i, bool * hybrid) {
    const llama_ridgefill_arch * a = llama_ridgefill_arch_at(i);
    if (hybrid) {
        *hybrid = a && a->hybrid;
    }
    return a ? a->name : nullptr;
}
