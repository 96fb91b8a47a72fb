// Loading RidgeFill map files (GGUF side tensors, docs/design.md §7) into backend buffers, modelled on the
// LoRA adapter loader (src/llama-adapter.cpp): metadata first, then one ggml context per buffer
// type, then raw reads. Everything that does not match the model is refused with a message.

#include "llama-ridgefill-maps.h"
#include "llama-ridgefill-error.h"
#include "llama-ridgefill-fingerprint.h"
#include "llama-ridgefill-params.h"

#include "llama-arch.h"
#include "llama-impl.h"
#include "llama-mmap.h"
#include "llama-model.h"

#include "ggml-backend.h"
#include "ggml-cpp.h"
#include "gguf.h"
#include "hash/xxhash/xxhash.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <stdexcept>

size_t llama_ridgefill_maps::n_bytes() const {
    size_t n = 0;
    for (const auto & buf : bufs) {
        n += ggml_backend_buffer_get_size(buf.get());
    }
    return n;
}

static bool rf_has_map(const llama_ridgefill_maps * maps, int il) {
    return maps != nullptr && il > maps->split_layer && (maps->a[il] != nullptr || maps->down[il] != nullptr);
}

ggml_tensor * llama_ridgefill_build_xhat(ggml_context * ctx0, const llama_ridgefill_maps * maps, int il, ggml_tensor * xs,
        const llama_ridgefill_map_weights * w) {
    if (!rf_has_map(maps, il)) {
        return xs; // identity fill (and l = S, where x_S is the layer's exact input)
    }
    const llama_ridgefill_map_weights own = { maps->a[il], maps->down[il], maps->up[il] };
    if (w == nullptr) {
        w = &own;
    }
    ggml_tensor * x = xs;
    if (maps->normalized) {
        x = ggml_rms_norm(ctx0, x, maps->norm_eps);
    }
    ggml_tensor * y = nullptr;
    if (w->a != nullptr) {
        y = ggml_mul_mat(ctx0, w->a, x);
    } else {
        GGML_ASSERT(w->down != nullptr && w->up != nullptr);
        y = ggml_mul_mat(ctx0, w->up, ggml_mul_mat(ctx0, w->down, x));
        if (maps->identity_low_rank) {
            y = ggml_add(ctx0, y, x);
        }
    }
    return ggml_add(ctx0, y, maps->b[il]);
}

llama_ridgefill_map_weights llama_ridgefill_stage(ggml_context * ctx0, const llama_ridgefill_maps * maps, int il) {
    if (!rf_has_map(maps, il)) {
        return {};
    }
    llama_ridgefill_map_weights w = { maps->a[il], maps->down[il], maps->up[il] };
    ggml_backend_dev_t dev = maps->model.dev_layer(il);
    if (!maps->host || dev == nullptr || ggml_backend_dev_type(dev) == GGML_BACKEND_DEVICE_TYPE_CPU) {
        return w;
    }
    for (ggml_tensor ** t : { &w.a, &w.down, &w.up }) {
        if (*t != nullptr) {
            ggml_tensor * staged = ggml_cont(ctx0, *t);
            ggml_format_name(staged, "%s_staged", (*t)->name);
            *t = staged;
        }
    }
    return w;
}

static const char * RIDGEFILL_ADAPTER_TYPE = "ridgefill";
static const char * RIDGEFILL_KEY_DIGEST   = "ridgefill.digest.xxh64";
static const char * RIDGEFILL_KEY_MAP_FORM = "ridgefill.map_form";
static const char * RIDGEFILL_KEY_MAP_RANKS = "ridgefill.map_ranks";
static const uint32_t RIDGEFILL_FORMAT_VERSION = 1;

namespace {

// typed metadata access with errors that name the key
struct gguf_meta {
    const gguf_context * ctx;
    std::string path;

    int64_t find(const char * key, bool required = true) const {
        const int64_t id = gguf_find_key(ctx, key);
        if (id < 0 && required) {
            throw std::runtime_error(format("%s: missing metadata key %s", path.c_str(), key));
        }
        return id;
    }

    std::string str(const char * key, bool required = true) const {
        const int64_t id = find(key, required);
        if (id < 0) {
            return "";
        }
        if (gguf_get_kv_type(ctx, id) != GGUF_TYPE_STRING) {
            throw std::runtime_error(format("%s: metadata key %s is not a string", path.c_str(), key));
        }
        return gguf_get_val_str(ctx, id);
    }

    uint32_t u32(const char * key) const {
        const int64_t id = find(key);
        if (gguf_get_kv_type(ctx, id) != GGUF_TYPE_UINT32) {
            throw std::runtime_error(format("%s: metadata key %s is not a uint32", path.c_str(), key));
        }
        return gguf_get_val_u32(ctx, id);
    }

    float f32(const char * key) const {
        const int64_t id = find(key);
        if (gguf_get_kv_type(ctx, id) != GGUF_TYPE_FLOAT32) {
            throw std::runtime_error(format("%s: metadata key %s is not a float32", path.c_str(), key));
        }
        return gguf_get_val_f32(ctx, id);
    }

    std::vector<int32_t> i32_array(const char * key) const {
        const int64_t id = find(key);
        if (gguf_get_kv_type(ctx, id) != GGUF_TYPE_ARRAY || gguf_get_arr_type(ctx, id) != GGUF_TYPE_INT32) {
            throw std::runtime_error(format("%s: metadata key %s is not an int32 array", path.c_str(), key));
        }
        const auto * data = (const int32_t *) gguf_get_arr_data(ctx, id);
        return std::vector<int32_t>(data, data + gguf_get_arr_n(ctx, id));
    }
};

// the maps' values must be finite: a NaN would silently poison every filled row. Quantized tensors
// are checked as they dequantize (a NaN block scale reads as NaN values), a row at a time
static void check_finite(const ggml_tensor * t, const uint8_t * data) {
    const int64_t n_per_row = t->ne[0];
    const int64_t n_rows    = ggml_nelements(t)/n_per_row;
    const size_t  row_size  = ggml_row_size(t->type, n_per_row);
    const auto  * traits    = ggml_get_type_traits(t->type);
    std::vector<float> row(t->type == GGML_TYPE_F32 ? 0 : n_per_row);
    for (int64_t r = 0; r < n_rows; ++r) {
        const float * v = (const float *) (data + r*row_size);
        if (t->type != GGML_TYPE_F32) {
            GGML_ASSERT(traits->to_float != nullptr);
            traits->to_float(data + r*row_size, row.data(), n_per_row);
            v = row.data();
        }
        for (int64_t i = 0; i < n_per_row; ++i) {
            if (!std::isfinite(v[i])) {
                throw std::runtime_error(format("tensor %s has a non-finite value (%f) at element %lld", t->name, v[i],
                        (long long) (r*n_per_row + i)));
            }
        }
    }
}

// the storage types a map matrix may have (ridgefill-gguf fit --dtype): mul_mat takes each on every backend
static bool rf_map_type_ok(ggml_type type) {
    switch (type) {
        case GGML_TYPE_F32:
        case GGML_TYPE_F16:
        case GGML_TYPE_Q8_0:
        case GGML_TYPE_Q4_0:
        case GGML_TYPE_Q4_K:
            return true;
        default:
            return false;
    }
}

} // namespace

// Loading a map file, as named steps that run in this order: the file, its metadata, the model's
// fingerprint before any tensor data is read, the map form, the tensors, their buffers, the content
// digests, then the data with its values checked. Each step reads what the ones before established.
struct llama_ridgefill_maps_loader {
    llama_ridgefill_maps              & maps;
    const llama_model                 & model;
    const std::string                   path;
    const llama_ridgefill_maps_params & params;

    gguf_context_ptr ctx_gguf;
    ggml_context_ptr ctx_meta;

    int32_t n_layer = 0;
    int32_t n_embd  = 0;
    int64_t n_tensors = 0;
    std::vector<int32_t> layers;    // the mapped layers, S+1 .. n_layer-1
    std::vector<int32_t> ranks;     // per mapped layer, low-rank forms only
    bool low_rank = false;

    std::map<ggml_backend_buffer_type_t, ggml_context *> ctx_map;
    std::vector<std::pair<ggml_tensor *, ggml_tensor *>> to_load; // (file tensor, buffer tensor)
    const ggml_tensor * first_matrix = nullptr;                    // every map matrix has this one's type
    std::map<std::string, std::string> digests;                    // tensor name -> XXH64 hex
    double t_digest_ms = 0.0;

    llama_ridgefill_maps_loader(llama_ridgefill_maps & maps, const char * path, const llama_ridgefill_maps_params & params) :
            maps(maps), model(maps.model), path(path), params(params),
            n_layer((int32_t) maps.model.hparams.n_layer()), n_embd((int32_t) maps.model.hparams.n_embd) {}

    gguf_meta meta() const { return { ctx_gguf.get(), path }; }

    [[noreturn]] void fail(const std::string & msg) const {
        throw std::runtime_error(path + ": " + msg);
    }

    void load() {
        open();
        read_header();
        check_fingerprint();
        read_form();
        create_tensors();
        alloc_buffers();
        read_digests();
        load_data();
        log_loaded();
    }

    // a readable GGUF file: its metadata and tensor descriptions, no data yet
    void open() {
        llama_ridgefill_check_regular_file(path.c_str(), "map file");
        ggml_context * ctx_init = nullptr;
        gguf_init_params meta_params = {
            /* .no_alloc = */ true,
            /* .ctx      = */ &ctx_init,
        };
        ctx_gguf.reset(gguf_init_from_file(path.c_str(), meta_params));
        if (!ctx_gguf) {
            fail("not a readable GGUF file (missing, truncated or corrupt)");
        }
        ctx_meta.reset(ctx_init);
        n_tensors = gguf_get_n_tensors(ctx_gguf.get());
        maps.path = path;
    }

    // what the file is and for which model: type, version, architecture, dimensions, split, the
    // objective and its input norm, the mapped layers, the tuned operating point
    void read_header() {
        const gguf_meta m = meta();
        const std::string general_type = m.str("general.type", false);
        const std::string adapter_type = m.str("adapter.type", false);
        if (general_type != "adapter" || adapter_type != RIDGEFILL_ADAPTER_TYPE) {
            fail(format("not a RidgeFill map file (general.type = '%s', adapter.type = '%s'; expected 'adapter', '%s')",
                    general_type.c_str(), adapter_type.c_str(), RIDGEFILL_ADAPTER_TYPE));
        }
        const uint32_t version = m.u32("ridgefill.format_version");
        if (version != RIDGEFILL_FORMAT_VERSION) {
            fail(format("map file format version %u, this build reads version %u", version, RIDGEFILL_FORMAT_VERSION));
        }
        const std::string arch = m.str("general.architecture");
        if (llm_arch_from_string(arch) != model.arch) {
            fail(format("maps are for architecture %s, the model is %s", arch.c_str(), llm_arch_name(model.arch)));
        }
        maps.n_layer     = (int32_t) m.u32("ridgefill.n_layer");
        maps.n_embd      = (int32_t) m.u32("ridgefill.n_embd");
        maps.split_layer = (int32_t) m.u32("ridgefill.split_layer");
        if (maps.n_layer != n_layer || maps.n_embd != n_embd) {
            fail(format("maps are for %d layers and n_embd %d, the model has %d layers and n_embd %d",
                    maps.n_layer, maps.n_embd, n_layer, n_embd));
        }
        if (maps.split_layer < 1 || maps.split_layer > n_layer - 2) {
            fail(format("split layer %d outside 1..%d", maps.split_layer, n_layer - 2));
        }
        if (params.split_layer >= 0 && params.split_layer != maps.split_layer) {
            fail(format("the maps were fitted for split %d, not the requested split %d", maps.split_layer, params.split_layer));
        }
        maps.objective = m.str("ridgefill.objective");
        const std::string input_norm = m.str("ridgefill.input_norm");
        if (!((maps.objective == "normalized" && input_norm == "rms") || (maps.objective == "raw" && input_norm == "none"))) {
            fail(format("unknown objective / input norm '%s' / '%s'", maps.objective.c_str(), input_norm.c_str()));
        }
        maps.normalized = input_norm == "rms";
        maps.norm_eps   = m.f32("ridgefill.input_norm_eps");
        // ggml_rms_norm asserts eps >= 0: a NaN or negative value would abort the first planned prefill
        if (!std::isfinite(maps.norm_eps) || maps.norm_eps < 0.0f || maps.norm_eps > LLAMA_RIDGEFILL_MAX_NORM_EPS) {
            fail(format("metadata key ridgefill.input_norm_eps = %g outside [0, %g]", maps.norm_eps, LLAMA_RIDGEFILL_MAX_NORM_EPS));
        }
        maps.fingerprint = m.str("ridgefill.model.fingerprint");

        const std::vector<int32_t> listed = m.i32_array("ridgefill.layers");
        for (int32_t il = maps.split_layer + 1; il < n_layer; ++il) {
            layers.push_back(il);
        }
        if (listed != layers) {
            fail(format("the file lists %zu mapped layers, expected layers %d..%d", listed.size(), maps.split_layer + 1, n_layer - 1));
        }
        maps.tuned = llama_ridgefill_read_tuned(ctx_gguf.get(), path);
    }

    // before any tensor data is read: maps of another checkpoint are refused at once
    void check_fingerprint() const {
        if (params.model_path == nullptr) {
            LLAMA_LOG_WARN("%s: %s: no model path given, the maps' model fingerprint is not checked\n", __func__, path.c_str());
            return;
        }
        const std::string fp = llama_ridgefill_model_fingerprint_file(params.model_path);
        if (fp != maps.fingerprint) {
            fail(format("the maps were fitted on model %s, %s is %s (another checkpoint): fit maps for this model",
                    maps.fingerprint.c_str(), params.model_path, fp.c_str()));
        }
    }

    // the map form: full matrices, or two low-rank factors per layer with their ranks
    void read_form() {
        const gguf_meta m = meta();
        maps.form = m.str(RIDGEFILL_KEY_MAP_FORM, false);
        if (maps.form.empty()) {
            maps.form = "full";
        }
        if (maps.form != "full" && maps.form != "identity_low_rank" && maps.form != "low_rank") {
            fail(format("metadata key %s = '%s': expected full, identity_low_rank or low_rank", RIDGEFILL_KEY_MAP_FORM, maps.form.c_str()));
        }
        low_rank = maps.form != "full";
        maps.identity_low_rank = maps.form == "identity_low_rank";
        if (!low_rank) {
            return;
        }
        ranks = m.i32_array(RIDGEFILL_KEY_MAP_RANKS);
        if (ranks.size() != layers.size()) {
            fail(format("metadata key %s lists %zu ranks, expected one per mapped layer (%zu)",
                    RIDGEFILL_KEY_MAP_RANKS, ranks.size(), layers.size()));
        }
        for (size_t i = 0; i < ranks.size(); ++i) {
            if (ranks[i] < 1 || ranks[i] >= n_embd) {
                fail(format("metadata key %s: layer %d has rank %d outside 1..%d", RIDGEFILL_KEY_MAP_RANKS, layers[i], ranks[i], n_embd - 1));
            }
        }
    }

    // where a tensor of layer il lives: with the layer's weights (resident), or in host memory for streaming
    ggml_backend_buffer_type_t buft_for(int32_t il) const {
        ggml_backend_dev_t dev = model.dev_layer(il);
        ggml_backend_buffer_type_t buft = nullptr;
        if (params.host) {
            buft = ggml_backend_dev_host_buffer_type(dev);
            if (buft == nullptr && dev != nullptr && ggml_backend_dev_type(dev) != GGML_BACKEND_DEVICE_TYPE_CPU) {
                // a device without host buffers (an RPC server): this machine's memory
                buft = ggml_backend_dev_buffer_type(ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU));
            }
        }
        return buft != nullptr ? buft : ggml_backend_dev_buffer_type(dev);
    }

    ggml_context * ctx_for_buft(ggml_backend_buffer_type_t buft) {
        auto it = ctx_map.find(buft);
        if (it != ctx_map.end()) {
            return it->second;
        }
        ggml_init_params ip = {
            /*.mem_size   =*/ (size_t) n_tensors * ggml_tensor_overhead(),
            /*.mem_buffer =*/ NULL,
            /*.no_alloc   =*/ true,
        };
        ggml_context * c = ggml_init(ip);
        if (!c) {
            throw std::runtime_error("failed to create a ggml context for the maps");
        }
        ctx_map[buft] = c;
        maps.ctxs.emplace_back(c);
        return c;
    }

    // per mapped layer one A (or its factors V^T and U) and one b, of the right shape and type;
    // optionally the state gains g of every mapped recurrent layer (hybrid models, the terminal-state
    // correction). Each gets its twin in the buffer type of its placement
    void create_tensors() {
        std::vector<int32_t> recurrent;
        for (int32_t il : layers) {
            if (model.hparams.is_recr(il)) {
                recurrent.push_back(il);
            }
        }
        const bool has_gains = !recurrent.empty() &&
                ggml_get_tensor(ctx_meta.get(), format("blk.%d.ridgefill_state_gain.weight", recurrent[0]).c_str()) != nullptr;
        const int64_t n_expected = (low_rank ? 3 : 2) * (int64_t) layers.size() + (has_gains ? (int64_t) recurrent.size() : 0);
        if (n_tensors != n_expected) {
            fail(format("%lld tensors, expected %lld (%s and b for each of layers %d..%d%s)",
                    (long long) n_tensors, (long long) n_expected, low_rank ? "V^T, U" : "A", maps.split_layer + 1, n_layer - 1,
                    has_gains ? ", a state gain for each recurrent one" : ""));
        }
        maps.a.assign(n_layer, nullptr);
        maps.down.assign(n_layer, nullptr);
        maps.up.assign(n_layer, nullptr);
        maps.b.assign(n_layer, nullptr);
        maps.g.assign(n_layer, nullptr);

        const int64_t n_v_heads = model.hparams.ssm_dt_rank;
        for (size_t i = 0; i < layers.size(); ++i) {
            const int32_t il = layers[i];
            // a: A [n_embd, n_embd]; d, u: V^T [n_embd, r], U [r, n_embd]; b: [n_embd]; g: [n_v_heads]
            for (const char kind : { 'a', 'd', 'u', 'b', 'g' }) {
                if ((kind == 'a' && low_rank) || ((kind == 'd' || kind == 'u') && !low_rank) ||
                    (kind == 'g' && !(has_gains && model.hparams.is_recr(il)))) {
                    continue;
                }
                const std::string name = format(kind == 'a' ? "blk.%d.ridgefill_a.weight" :
                                                kind == 'd' ? "blk.%d.ridgefill_a_down.weight" :
                                                kind == 'u' ? "blk.%d.ridgefill_a_up.weight" :
                                                kind == 'b' ? "blk.%d.ridgefill_b.bias" : "blk.%d.ridgefill_state_gain.weight", il);
                ggml_tensor * t = ggml_get_tensor(ctx_meta.get(), name.c_str());
                if (t == nullptr) {
                    fail(format("missing tensor %s", name.c_str()));
                }
                const bool is_matrix = kind == 'a' || kind == 'd' || kind == 'u';
                const int64_t r = low_rank ? ranks[i] : n_embd;
                const int64_t ne0 = kind == 'g' ? n_v_heads : kind == 'u' ? r : n_embd;
                const int64_t ne1 = kind == 'a' ? n_embd : kind == 'd' ? r : kind == 'u' ? n_embd : 1;
                const bool shape_ok = t->ne[0] == ne0 && t->ne[1] == ne1 && ggml_n_dims(t) == (is_matrix ? 2 : 1);
                const bool type_ok = is_matrix ? rf_map_type_ok(t->type) : t->type == GGML_TYPE_F32;
                if (!shape_ok || !type_ok) {
                    fail(format("tensor %s is %s [%lld, %lld], expected %s [%lld%s]", name.c_str(),
                            ggml_type_name(t->type), (long long) t->ne[0], (long long) t->ne[1],
                            is_matrix ? "F32/F16/Q8_0/Q4_0/Q4_K" : "F32", (long long) ne0,
                            is_matrix ? format(", %lld", (long long) ne1).c_str() : ""));
                }
                if (is_matrix) {
                    if (first_matrix == nullptr) {
                        first_matrix = t;
                    } else if (t->type != first_matrix->type) {
                        fail(format("tensor %s is %s, %s is %s: every map matrix of a file has one type",
                                name.c_str(), ggml_type_name(t->type), first_matrix->name, ggml_type_name(first_matrix->type)));
                    }
                }
                ggml_tensor * dst = ggml_dup_tensor(ctx_for_buft(buft_for(il)), t);
                ggml_set_name(dst, t->name);
                (kind == 'a' ? maps.a : kind == 'd' ? maps.down : kind == 'u' ? maps.up : kind == 'b' ? maps.b : maps.g)[il] = dst;
                to_load.emplace_back(t, dst);
            }
        }
    }

    void alloc_buffers() {
        for (auto & it : ctx_map) {
            ggml_backend_buffer_ptr buf { ggml_backend_alloc_ctx_tensors_from_buft(it.second, it.first) };
            if (!buf) {
                throw std::runtime_error(format("failed to allocate a %s buffer for the maps", ggml_backend_buft_name(it.first)));
            }
            // weights usage: the scheduler's op offload then streams host-resident maps to the accelerator
            ggml_backend_buffer_set_usage(buf.get(), GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
            maps.buft_names += std::string(maps.buft_names.empty() ? "" : ",") + ggml_backend_buft_name(it.first);
            maps.bufs.emplace_back(std::move(buf));
        }
        maps.host = params.host;
    }

    // the content digests fit wrote: one "NAME HEX" per tensor, XXH64 of its bytes. A file without
    // one (written before digests existed, or its key removed) is refused unless
    // LLAMA_RIDGEFILL_ALLOW_UNDIGESTED=1: a changed byte in it could not be detected
    void read_digests() {
        const int64_t id = meta().find(RIDGEFILL_KEY_DIGEST, false);
        if (id < 0) {
            const char * env = getenv("LLAMA_RIDGEFILL_ALLOW_UNDIGESTED");
            if (env == nullptr || atoi(env) <= 0) {
                fail(format("the file has no content digest (%s), so corrupted map weights could not be detected: "
                        "add one with `ridgefill-gguf digest FILE` if you trust its bytes (or fit the maps again), "
                        "or set LLAMA_RIDGEFILL_ALLOW_UNDIGESTED=1 to load it unchecked", RIDGEFILL_KEY_DIGEST));
            }
            LLAMA_LOG_WARN("%s: %s has no content digest (%s), loaded unchecked (LLAMA_RIDGEFILL_ALLOW_UNDIGESTED): "
                    "corrupted map weights cannot be detected; `ridgefill-gguf digest` adds one\n", __func__, path.c_str(), RIDGEFILL_KEY_DIGEST);
            return;
        }
        if (gguf_get_kv_type(ctx_gguf.get(), id) != GGUF_TYPE_ARRAY || gguf_get_arr_type(ctx_gguf.get(), id) != GGUF_TYPE_STRING) {
            fail(format("metadata key %s is not a string array", RIDGEFILL_KEY_DIGEST));
        }
        for (size_t i = 0; i < gguf_get_arr_n(ctx_gguf.get(), id); ++i) {
            const std::string entry = gguf_get_arr_str(ctx_gguf.get(), id, i);
            const size_t sep = entry.find(' ');
            if (sep == std::string::npos || entry.size() - sep - 1 != 16 || !digests.emplace(entry.substr(0, sep), entry.substr(sep + 1)).second) {
                fail(format("metadata key %s: malformed entry '%.80s' (expected 'TENSOR HEX16', one per tensor)",
                        RIDGEFILL_KEY_DIGEST, entry.c_str()));
            }
        }
        if ((int64_t) digests.size() != n_tensors) {
            fail(format("%s lists %zu tensors, the file has %lld: the file was altered after it was written",
                    RIDGEFILL_KEY_DIGEST, digests.size(), (long long) n_tensors));
        }
    }

    // the tensors' bytes: each checked against its digest and for finite values, then copied to its buffer
    void load_data() {
        llama_file file(path.c_str(), "rb");
        std::vector<uint8_t> data;
        for (auto & [src, dst] : to_load) {
            const size_t offs = gguf_get_data_offset(ctx_gguf.get()) + gguf_get_tensor_offset(ctx_gguf.get(), gguf_find_tensor(ctx_gguf.get(), src->name));
            const size_t size = ggml_nbytes(src);
            if (offs + size < offs || offs + size > file.size()) {
                fail(format("tensor %s runs past the end of the file (truncated?)", src->name));
            }
            data.resize(size);
            file.seek(offs, SEEK_SET);
            file.read_raw(data.data(), size);
            if (!digests.empty()) {
                check_digest(src->name, data);
            }
            try {
                check_finite(src, data.data());
            } catch (const std::exception & e) {
                fail(e.what());
            }
            ggml_backend_tensor_set(dst, data.data(), 0, size);
        }
        maps.digest_checked = !digests.empty();
        maps.type_name = ggml_type_name(first_matrix->type);
        std::transform(maps.type_name.begin(), maps.type_name.end(), maps.type_name.begin(), [](unsigned char c) { return (char) std::tolower(c); });
    }

    void check_digest(const char * name, const std::vector<uint8_t> & data) {
        const auto t0 = std::chrono::steady_clock::now();
        const std::string got = format("%016llx", (unsigned long long) XXH64(data.data(), data.size(), 0));
        t_digest_ms += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
        const auto it = digests.find(name);
        if (it == digests.end()) {
            fail(format("tensor %s has no entry in %s: the file was altered after it was written", name, RIDGEFILL_KEY_DIGEST));
        }
        if (it->second != got) {
            fail(format("tensor %s: its bytes give xxh64 %s, the file records %s: the file was corrupted after it was "
                    "written (copy it again, or fit new maps)", name, got.c_str(), it->second.c_str()));
        }
    }

    void log_loaded() const {
        LLAMA_LOG_INFO("%s: loaded RidgeFill maps for layers %d..%d (split %d, objective %s, %s %s) from %s, %.2f MiB in %s (%s), %s\n",
                __func__, maps.split_layer + 1, n_layer - 1, maps.split_layer, maps.objective.c_str(), maps.form.c_str(),
                maps.type_name.c_str(), path.c_str(), maps.n_bytes() / 1024.0 / 1024.0, maps.buft_names.c_str(),
                maps.host ? "host placement" : "resident",
                maps.digest_checked ? format("content digest checked in %.1f ms", t_digest_ms).c_str() : "no content digest");
    }
};

struct llama_ridgefill_maps_params llama_ridgefill_maps_default_params(void) {
    llama_ridgefill_maps_params p = {
        /*.split_layer =*/ -1,
        /*.host        =*/ false,
        /*.model_path  =*/ nullptr,
    };
    return p;
}

struct llama_ridgefill_maps * llama_ridgefill_maps_init(const struct llama_model * model, const char * path, struct llama_ridgefill_maps_params params) {
    if (model == nullptr || path == nullptr) {
        llama_ridgefill_set_error(__func__, "model and path are required");
        return nullptr;
    }
    auto maps = std::make_unique<llama_ridgefill_maps>(*model);
    try {
        llama_ridgefill_maps_loader(*maps, path, params).load();
    } catch (const std::exception & e) {
        llama_ridgefill_set_error(__func__, e.what());
        return nullptr;
    }
    llama_ridgefill_clear_error();
    return maps.release();
}

void llama_ridgefill_maps_free(struct llama_ridgefill_maps * maps) {
    delete maps;
}

int32_t llama_ridgefill_maps_split_layer(const struct llama_ridgefill_maps * maps) {
    return maps->split_layer;
}

const char * llama_ridgefill_maps_fingerprint(const struct llama_ridgefill_maps * maps) {
    return maps->fingerprint.c_str();
}

uint64_t llama_ridgefill_maps_n_bytes(const struct llama_ridgefill_maps * maps) {
    return maps->n_bytes();
}

const char * llama_ridgefill_maps_buffer_types(const struct llama_ridgefill_maps * maps) {
    return maps->buft_names.c_str();
}

bool llama_ridgefill_maps_has_state_gains(const struct llama_ridgefill_maps * maps) {
    return maps && std::any_of(maps->g.begin(), maps->g.end(), [](const ggml_tensor * t) { return t != nullptr; });
}

bool llama_ridgefill_maps_digest_checked(const struct llama_ridgefill_maps * maps) {
    return maps->digest_checked;
}

bool llama_ridgefill_maps_host(const struct llama_ridgefill_maps * maps) {
    return maps->host;
}

const char * llama_ridgefill_maps_type(const struct llama_ridgefill_maps * maps) {
    return maps->type_name.c_str();
}

const char * llama_ridgefill_maps_form(const struct llama_ridgefill_maps * maps) {
    return maps->form.c_str();
}

int32_t llama_ridgefill_maps_predict(const struct llama_ridgefill_maps * maps, int32_t il, const float * xs, int32_t n_rows, float * out) {
    if (maps == nullptr || il < maps->split_layer || il >= maps->n_layer || n_rows <= 0) {
        llama_ridgefill_set_error(__func__, format("layer %d outside %d..%d or no rows", il, maps ? maps->split_layer : -1, maps ? maps->n_layer - 1 : -1));
        return -1;
    }
    const ggml_tensor * m = il > maps->split_layer ? (maps->a[il] ? maps->a[il] : maps->down[il]) : nullptr;
    if (m && !ggml_backend_buffer_is_host(m->buffer)) {
        llama_ridgefill_set_error(__func__, "maps are not in host memory");
        return -1;
    }
    const int64_t n_embd = maps->n_embd;
    ggml_init_params ip = {
        /*.mem_size   =*/ 16 * ggml_tensor_overhead() + ggml_graph_overhead(),
        /*.mem_buffer =*/ NULL,
        /*.no_alloc   =*/ true,
    };
    ggml_context_ptr ctx { ggml_init(ip) };
    ggml_tensor * x = ggml_new_tensor_2d(ctx.get(), GGML_TYPE_F32, n_embd, n_rows);
    ggml_tensor * y = ggml_cont(ctx.get(), llama_ridgefill_build_xhat(ctx.get(), maps, il, x));
    ggml_cgraph * gf = ggml_new_graph(ctx.get());
    ggml_build_forward_expand(gf, y);

    ggml_backend_ptr backend { ggml_backend_init_by_type(GGML_BACKEND_DEVICE_TYPE_CPU, nullptr) };
    if (!backend) {
        llama_ridgefill_set_error(__func__, "no CPU backend");
        return -1;
    }
    ggml_backend_buffer_ptr buf { ggml_backend_alloc_ctx_tensors(ctx.get(), backend.get()) };
    ggml_backend_tensor_set(x, xs, 0, ggml_nbytes(x));
    if (ggml_backend_graph_compute(backend.get(), gf) != GGML_STATUS_SUCCESS) {
        llama_ridgefill_set_error(__func__, "graph compute failed");
        return -1;
    }
    ggml_backend_tensor_get(y, out, 0, ggml_nbytes(y));
    return 0;
}
