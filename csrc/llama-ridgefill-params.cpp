#include "llama-ridgefill-params.h"

#include "llama-ridgefill-error.h"

#include "llama-impl.h"

#include "ggml-cpp.h"
#include "gguf.h"

#include <climits>
#include <cmath>
#include <cstring>
#include <stdexcept>

// every default of RidgeFill, here and nowhere else (docs/design.md §5: how each was chosen)
static const llama_ridgefill_params RIDGEFILL_BUILTIN = {
    /*.split_layer       =*/ -1,
    /*.n_tail            =*/ 64,
    /*.exact_fraction    =*/ 0.10,
    /*.selector          =*/ LLAMA_RIDGEFILL_SELECTOR_ATTENTION,
    /*.n_sel_queries     =*/ 64,
    /*.sel_layer         =*/ -1,
    /*.n_rescale         =*/ 512,
    /*.min_prompt        =*/ 1024,
    /*.n_fill_chunk      =*/ 0,
    /*.splice            =*/ LLAMA_RIDGEFILL_SPLICE_NONE,
    /*.n_key_rescale     =*/ 0,
    /*.protected_classes =*/ LLAMA_RIDGEFILL_CLASS_SINK | LLAMA_RIDGEFILL_CLASS_DIGIT,
    /*.state_correction  =*/ LLAMA_RIDGEFILL_STATE_CORRECTION_NONE,
    /*.span              =*/ 16,
};

static const char * RIDGEFILL_TUNED_PREFIX = "ridgefill.tuned.";

static const struct {
    const char * name;
    int32_t      selector;
} RIDGEFILL_SELECTORS[] = {
    { "none",                LLAMA_RIDGEFILL_SELECTOR_NONE                },
    { "attention",           LLAMA_RIDGEFILL_SELECTOR_ATTENTION           },
    { "probe",               LLAMA_RIDGEFILL_SELECTOR_PROBE               },
    { "protected",           LLAMA_RIDGEFILL_SELECTOR_PROTECTED           },
    { "attention+protected", LLAMA_RIDGEFILL_SELECTOR_ATTENTION_PROTECTED },
};

struct llama_ridgefill_params llama_ridgefill_builtin_params(void) {
    return RIDGEFILL_BUILTIN;
}

struct llama_ridgefill_params llama_ridgefill_default_params(void) {
    llama_ridgefill_params p = RIDGEFILL_BUILTIN;
    p.n_tail         = LLAMA_RIDGEFILL_UNSET;
    p.exact_fraction = LLAMA_RIDGEFILL_UNSET;
    p.selector       = LLAMA_RIDGEFILL_UNSET;
    p.span           = LLAMA_RIDGEFILL_UNSET;
    p.n_key_rescale  = LLAMA_RIDGEFILL_UNSET;
    return p;
}

const char * llama_ridgefill_selector_name(int32_t selector) {
    for (const auto & s : RIDGEFILL_SELECTORS) {
        if (s.selector == selector) {
            return s.name;
        }
    }
    return nullptr;
}

int32_t llama_ridgefill_selector_from_name(const char * name) {
    for (const auto & s : RIDGEFILL_SELECTORS) {
        if (name != nullptr && strcmp(s.name, name) == 0) {
            return s.selector;
        }
    }
    return -1;
}

const char * llama_ridgefill_selector_names(void) {
    static const std::string names = [] {
        std::string res;
        for (const auto & s : RIDGEFILL_SELECTORS) {
            res += std::string(res.empty() ? "" : ", ") + s.name;
        }
        return res;
    }();
    return names.c_str();
}

llama_ridgefill_tuned llama_ridgefill_read_tuned(const gguf_context * ctx, const std::string & path) {
    llama_ridgefill_tuned tuned;
    auto find = [&](const char * name, gguf_type type, const char * what) -> int64_t {
        const std::string key = std::string(RIDGEFILL_TUNED_PREFIX) + name;
        const int64_t id = gguf_find_key(ctx, key.c_str());
        if (id >= 0 && gguf_get_kv_type(ctx, id) != type) {
            throw std::runtime_error(format("%s: metadata key %s is not a %s", path.c_str(), key.c_str(), what));
        }
        return id;
    };
    if (const int64_t id = find("tail", GGUF_TYPE_UINT32, "uint32"); id >= 0) {
        tuned.has   |= LLAMA_RIDGEFILL_TUNABLE_TAIL;
        tuned.n_tail = gguf_get_val_u32(ctx, id);
    }
    if (const int64_t id = find("exact_fraction", GGUF_TYPE_FLOAT64, "float64"); id >= 0) {
        tuned.has           |= LLAMA_RIDGEFILL_TUNABLE_EXACT_FRACTION;
        tuned.exact_fraction = gguf_get_val_f64(ctx, id);
    }
    if (const int64_t id = find("selector", GGUF_TYPE_STRING, "string"); id >= 0) {
        tuned.has     |= LLAMA_RIDGEFILL_TUNABLE_SELECTOR;
        tuned.selector = gguf_get_val_str(ctx, id);
    }
    if (const int64_t id = find("span", GGUF_TYPE_UINT32, "uint32"); id >= 0) {
        tuned.has |= LLAMA_RIDGEFILL_TUNABLE_SPAN;
        tuned.span = gguf_get_val_u32(ctx, id);
    }
    if (const int64_t id = find("key_rescale", GGUF_TYPE_UINT32, "uint32"); id >= 0) {
        tuned.has          |= LLAMA_RIDGEFILL_TUNABLE_KEY_RESCALE;
        tuned.n_key_rescale = gguf_get_val_u32(ctx, id);
    }
    return tuned;
}

// a tuned integer that applies, in lo..hi
static int32_t rf_tuned_int(const std::string & path, const char * name, int64_t value, int64_t lo, int64_t hi) {
    if (value < lo || value > hi) {
        throw std::runtime_error(format("%s: %s %lld must be %s %lld (the map file's tuned value, %s%s)", path.c_str(), name,
                (long long) value, value < lo ? ">=" : "<=", (long long) (value < lo ? lo : hi), RIDGEFILL_TUNED_PREFIX, name));
    }
    return (int32_t) value;
}

int32_t llama_ridgefill_apply_tuned(const llama_ridgefill_tuned * tuned, const std::string & path, llama_ridgefill_params & params) {
    const int32_t has = tuned ? tuned->has : 0;
    int32_t from_file = 0;
    // an unset integer field: the tuned value (in lo..hi) when the file has one, else the built-in one
    auto take_int = [&](int32_t & field, int32_t bit, const char * name, int64_t value, int64_t lo, int64_t hi, int32_t builtin) {
        if (field == LLAMA_RIDGEFILL_UNSET) {
            field      = (has & bit) ? rf_tuned_int(path, name, value, lo, hi) : builtin;
            from_file |= has & bit;
        }
    };
    take_int(params.n_tail, LLAMA_RIDGEFILL_TUNABLE_TAIL, "tail", tuned ? tuned->n_tail : 0, 1, INT32_MAX, RIDGEFILL_BUILTIN.n_tail);
    take_int(params.span, LLAMA_RIDGEFILL_TUNABLE_SPAN, "span", tuned ? tuned->span : 0, 1, LLAMA_RIDGEFILL_MAX_SPAN,
            RIDGEFILL_BUILTIN.span);
    take_int(params.n_key_rescale, LLAMA_RIDGEFILL_TUNABLE_KEY_RESCALE, "key_rescale", tuned ? tuned->n_key_rescale : 0, 0,
            INT32_MAX, RIDGEFILL_BUILTIN.n_key_rescale);
    if (params.exact_fraction == LLAMA_RIDGEFILL_UNSET) {
        params.exact_fraction = RIDGEFILL_BUILTIN.exact_fraction;
        if (has & LLAMA_RIDGEFILL_TUNABLE_EXACT_FRACTION) {
            const double f = tuned->exact_fraction;
            if (!std::isfinite(f) || f < 0.0 || f > 1.0) {
                throw std::runtime_error(format("%s: exact_fraction %g outside [0, 1] (the map file's tuned value, %sexact_fraction)",
                        path.c_str(), f, RIDGEFILL_TUNED_PREFIX));
            }
            params.exact_fraction = f;
            from_file |= LLAMA_RIDGEFILL_TUNABLE_EXACT_FRACTION;
        }
    }
    if (params.selector == LLAMA_RIDGEFILL_UNSET) {
        params.selector = RIDGEFILL_BUILTIN.selector;
        if (has & LLAMA_RIDGEFILL_TUNABLE_SELECTOR) {
            params.selector = llama_ridgefill_selector_from_name(tuned->selector.c_str());
            if (params.selector < 0) {
                throw std::runtime_error(format("%s: selector '%s' is not a selector (the map file's tuned value, %sselector)",
                        path.c_str(), tuned->selector.c_str(), RIDGEFILL_TUNED_PREFIX));
            }
            from_file |= LLAMA_RIDGEFILL_TUNABLE_SELECTOR;
        }
    }
    return from_file;
}

int32_t llama_ridgefill_resolve_params(const char * maps_path, struct llama_ridgefill_params * params) {
    if (params == nullptr) {
        llama_ridgefill_set_error(__func__, "no parameters");
        return -1;
    }
    try {
        if (maps_path == nullptr) {
            const int32_t from_file = llama_ridgefill_apply_tuned(nullptr, "", *params);
            llama_ridgefill_clear_error();
            return from_file;
        }
        llama_ridgefill_check_regular_file(maps_path, "map file");
        gguf_init_params meta_params = {
            /* .no_alloc = */ true,
            /* .ctx      = */ nullptr,
        };
        gguf_context_ptr ctx_gguf { gguf_init_from_file(maps_path, meta_params) };
        if (!ctx_gguf) {
            throw std::runtime_error(format("%s: not a readable GGUF file (missing, truncated or corrupt)", maps_path));
        }
        const llama_ridgefill_tuned tuned = llama_ridgefill_read_tuned(ctx_gguf.get(), maps_path);
        llama_ridgefill_params p = *params;
        const int32_t from_file = llama_ridgefill_apply_tuned(&tuned, maps_path, p);
        *params = p;
        llama_ridgefill_clear_error();
        return from_file;
    } catch (const std::exception & e) {
        llama_ridgefill_set_error(__func__, e.what());
        return -1;
    }
}
