// RidgeFill in llama-server (ridgefill-cpp): see server-ridgefill.h

#include "server-ridgefill.h"

#include "ggml.h"
#include "log.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

// the selector names, from libllama
static std::string rf_selector_names() {
    return llama_ridgefill_selector_names();
}

// a selector's name for the log, /props and the statistics ("?": none)
static const char * rf_selector_name(int32_t selector) {
    const char * name = llama_ridgefill_selector_name(selector);
    return name != nullptr ? name : "?";
}

int32_t server_ridgefill_filled::count_before(llama_pos p) const {
    return (int32_t) (std::lower_bound(pos.begin(), pos.end(), p) - pos.begin());
}

void server_ridgefill_filled::keep_before(llama_pos p) {
    pos.resize(count_before(p));
}

void server_ridgefill_filled::discard(llama_pos p0, int32_t n) {
    const auto first = std::lower_bound(pos.begin(), pos.end(), p0);
    const auto last  = std::lower_bound(first, pos.end(), p0 + n);
    for (auto it = last; it != pos.end(); ++it) {
        *it -= n;
    }
    pos.erase(first, last);
}

bool server_ridgefill_configured(const common_params_ridgefill & params) {
    return !params.maps.empty() || params.split >= 0;
}

std::string server_ridgefill_disable_for_embeddings(common_params_ridgefill & params, bool embedding) {
    if (!embedding || !server_ridgefill_configured(params)) {
        return "";
    }
    params = common_params_ridgefill();
    return "RidgeFill: off for this server: embeddings and reranking (--embedding, --reranking) pool every layer "
           "of every prompt row, which RidgeFill skips; prompts run stock prefill";
}

bool server_ridgefill_to_params(const common_params_ridgefill & params, llama_ridgefill_params & out, std::string & error) {
    out = llama_ridgefill_default_params();
    out.split_layer    = params.split >= 0 ? params.split : -1;
    out.n_tail         = params.n_tail;
    out.exact_fraction = params.exact_fraction;
    out.span           = params.span;
    out.n_key_rescale  = params.n_key_rescale;
    out.min_prompt     = params.min_prompt;
    if (!params.selector.empty()) {
        out.selector = llama_ridgefill_selector_from_name(params.selector.c_str());
        if (out.selector < 0) {
            error = "--ridgefill-selector " + params.selector + ": use one of " + rf_selector_names();
            return false;
        }
    }
    return true;
}

// a client's value in an error message: the first RF_QUOTE_MAX characters of its JSON text, written
// without visiting more of the value than those characters show. nlohmann's dump() recurses once
// per level of nesting, so a value nested 100,000 deep would overflow the stack; here each level
// writes at least one character, which bounds the depth by RF_QUOTE_MAX as well
static const size_t RF_QUOTE_MAX = 64;

static void rf_dump_bounded(const common_json & value, std::string & out) {
    if (value.is_array() || value.is_object()) {
        const bool is_array = value.is_array();
        out += is_array ? '[' : '{';
        for (auto it = value.begin(); it != value.end(); ++it) {
            if (out.size() > RF_QUOTE_MAX) {
                return;
            }
            if (it != value.begin()) {
                out += ',';
            }
            if (!is_array) {
                rf_dump_bounded(common_json(it.key()), out);
                out += ':';
            }
            rf_dump_bounded(it.value(), out);
        }
        out += is_array ? ']' : '}';
    } else if (value.is_string()) {
        // a long string is cut before it is escaped
        out += common_json(value.get<std::string>().substr(0, RF_QUOTE_MAX + 1)).dump_safe();
    } else {
        out += value.dump();
    }
}

static std::string rf_quote(const common_json & value) {
    std::string out;
    rf_dump_bounded(value, out);
    if (out.size() <= RF_QUOTE_MAX) {
        return out;
    }
    out.resize(RF_QUOTE_MAX);
    if (value.is_string()) {
        return out + "... (a string of " + std::to_string(value.get<std::string>().size()) + " bytes)";
    }
    const size_t n = value.size();
    if (value.is_array()) {
        return out + "... (an array of " + std::to_string(n) + (n == 1 ? " element)" : " elements)");
    }
    return out + "... (an object of " + std::to_string(n) + (n == 1 ? " member)" : " members)");
}

server_ridgefill_request server_ridgefill_parse_request(const common_json & value, bool enabled_on_server) {
    server_ridgefill_request req;
    if (value.is_boolean()) {
        req.enabled = value.get<bool>();
    } else if (value.is_object()) {
        for (const auto & [key, val] : value.items()) {
            if (key == "tail") {
                if (!val.is_number_integer() || val.get<long long>() < 1 || val.get<long long>() > INT32_MAX) {
                    throw std::invalid_argument("\"tail\" must be an integer >= 1 (the last prompt rows, always exact), got " + rf_quote(val));
                }
                req.n_tail = (int32_t) val.get<long long>();
            } else if (key == "exact_fraction") {
                if (!val.is_number() || !(val.get<double>() >= 0.0 && val.get<double>() <= 1.0)) {
                    throw std::invalid_argument("\"exact_fraction\" must be a number in [0, 1], got " + rf_quote(val));
                }
                req.exact_fraction = val.get<double>();
            } else if (key == "selector") {
                // the whole string, not its C prefix: "attention\u0000junk" is no selector's name
                const std::string name = val.is_string() ? val.get<std::string>() : std::string();
                const int32_t sel = name.find('\0') == std::string::npos ? llama_ridgefill_selector_from_name(name.c_str()) : -1;
                if (sel < 0) {
                    throw std::invalid_argument("\"selector\" must be one of " + rf_selector_names() + ", got " + rf_quote(val));
                }
                req.selector = sel;
            } else if (key == "span") {
                if (!val.is_number_integer() || val.get<long long>() < 1 || val.get<long long>() > LLAMA_RIDGEFILL_MAX_SPAN) {
                    throw std::invalid_argument("\"span\" must be an integer in 1.." + std::to_string(LLAMA_RIDGEFILL_MAX_SPAN) +
                            " (rows kept exact around each top-scoring row; 1: single rows), got " + rf_quote(val));
                }
                req.span = (int32_t) val.get<long long>();
            } else {
                throw std::invalid_argument("unknown member " + rf_quote(common_json(key)) + " (use tail, exact_fraction, selector, span)");
            }
        }
    } else {
        throw std::invalid_argument("must be false (exact prefill), true (the server's RidgeFill settings) or an object "
                "with tail, exact_fraction, selector and span, got " + rf_quote(value));
    }
    if (req.enabled && !enabled_on_server) {
        throw std::invalid_argument("this server runs without RidgeFill (start it with --ridgefill-maps or --ridgefill-split); "
                "only false is accepted");
    }
    return req;
}

server_ridgefill_admission server_ridgefill_admit(int64_t n_ctx, int64_t n_need,
        const std::vector<server_ridgefill_slot_cells> & others) {
    int64_t n_busy   = 0;
    int64_t n_cached = 0;
    for (const auto & o : others) {
        if (o.running) {
            n_busy += o.n_rows + o.n_rest;
        } else {
            n_cached += o.n_rows;
        }
    }
    if (n_busy > 0 && n_busy + n_need > n_ctx) {
        return SERVER_RIDGEFILL_WAIT;
    }
    // alone, a prompt too long for the cache is refused by the server's own checks
    return n_busy + n_cached + n_need > n_ctx ? SERVER_RIDGEFILL_ADMIT_AFTER_PURGE : SERVER_RIDGEFILL_ADMIT;
}

server_ridgefill::~server_ridgefill() {
    if (ctx) {
        llama_ridgefill_detach(ctx);
    }
    llama_ridgefill_maps_free(maps);
}

bool server_ridgefill::init(const common_params_ridgefill & params, const std::string & model_path, llama_model * model,
        llama_context * ctx, std::string & error) {
    if (!server_ridgefill_configured(params)) {
        return true;
    }
    if (!server_ridgefill_to_params(params, defaults, error)) {
        return false;
    }
    if (!params.maps.empty()) {
        llama_ridgefill_maps_params mparams = llama_ridgefill_maps_default_params();
        mparams.split_layer = defaults.split_layer;
        mparams.model_path  = model_path.c_str();
        maps = llama_ridgefill_maps_init(model, params.maps.c_str(), mparams);
        if (maps == nullptr) {
            error = "--ridgefill-maps " + params.maps + ": " + llama_ridgefill_last_error();
            return false;
        }
    }
    if (llama_ridgefill_attach(ctx, maps, defaults) != 0) {
        error = std::string("RidgeFill: ") + llama_ridgefill_last_error();
        llama_ridgefill_maps_free(maps);
        maps = nullptr;
        return false;
    }
    // the settings as attached: unset ones from the map file's tuned values, else built in
    const int32_t from_maps = llama_ridgefill_get_params(ctx, &defaults);
    attached    = defaults;
    is_attached = true;
    maps_path   = params.maps;
    this->ctx   = ctx;
    const auto origin = [&](int32_t bit, bool given) {
        return given ? "" : (from_maps & bit) ? " (map file)" : " (built-in)";
    };
    LOG_INF("%s: RidgeFill on: %s, split %d of %d, tail %d%s, exact fraction %.3g%s, selector %s%s (span %d%s), "
            "key rescale %d%s, prompts of >= %d new rows\n",
            __func__, maps ? params.maps.c_str() : "identity fill", defaults.split_layer, llama_model_n_layer(model),
            defaults.n_tail, origin(LLAMA_RIDGEFILL_TUNABLE_TAIL, params.n_tail != LLAMA_RIDGEFILL_UNSET),
            defaults.exact_fraction, origin(LLAMA_RIDGEFILL_TUNABLE_EXACT_FRACTION, params.exact_fraction != LLAMA_RIDGEFILL_UNSET),
            rf_selector_name(defaults.selector), origin(LLAMA_RIDGEFILL_TUNABLE_SELECTOR, !params.selector.empty()),
            defaults.span, origin(LLAMA_RIDGEFILL_TUNABLE_SPAN, params.span != LLAMA_RIDGEFILL_UNSET),
            defaults.n_key_rescale, origin(LLAMA_RIDGEFILL_TUNABLE_KEY_RESCALE, params.n_key_rescale != LLAMA_RIDGEFILL_UNSET),
            defaults.min_prompt);
    return true;
}

common_json server_ridgefill::props() const {
    if (!enabled()) {
        return nullptr;
    }
    common_json res;
    res["maps"]           = maps_path;
    res["split"]          = defaults.split_layer;
    res["tail"]           = defaults.n_tail;
    res["exact_fraction"] = defaults.exact_fraction;
    res["selector"]       = rf_selector_name(defaults.selector);
    res["span"]           = defaults.span;
    res["key_rescale"]    = defaults.n_key_rescale;
    res["min_prompt"]     = defaults.min_prompt;
    return res;
}

llama_ridgefill_params server_ridgefill::params_for(const server_ridgefill_request & req) const {
    llama_ridgefill_params p = defaults;
    if (req.n_tail >= 0) {
        p.n_tail = req.n_tail;
    }
    if (req.exact_fraction >= 0.0) {
        p.exact_fraction = req.exact_fraction;
    }
    if (req.selector >= 0) {
        p.selector = req.selector;
        p.sel_layer = -1; // the default layer of the new selector
    }
    if (req.span >= 0) {
        p.span = req.span;
    }
    return p;
}

bool server_ridgefill::wants(const server_ridgefill_request & req, int32_t n_rows) const {
    if (exact(req) || req.backend_sampling) {
        return false;
    }
    const llama_ridgefill_params p = params_for(req);
    const int32_t n_layer = llama_model_n_layer(llama_get_model(ctx));
    return p.split_layer < n_layer && n_rows > p.n_tail && n_rows >= p.min_prompt;
}

static bool rf_same_params(const llama_ridgefill_params & a, const llama_ridgefill_params & b) {
    return a.n_tail == b.n_tail && a.exact_fraction == b.exact_fraction && a.selector == b.selector && a.span == b.span;
}

int32_t server_ridgefill::begin(const server_ridgefill_request & req, llama_seq_id seq_id, llama_pos pos0, llama_pos pos_end,
        int32_t n_cached, const server_ridgefill_filled & filled, common_json & stats, std::string & error) {
    stats = common_json();
    if (!enabled()) {
        return 0;
    }
    const int32_t n_rows = pos_end - pos0;
    stats["requested"] = req.enabled;
    stats["applied"]   = false;
    stats["n_prompt"]  = n_rows;
    if (n_cached > 0) {
        // the rows before the new ones came from the slot's cache: those RidgeFill filled are approximate
        stats["n_cached"]        = n_cached;
        stats["n_cached_filled"] = filled.count_before(pos0);
    }
    const llama_ridgefill_params p = params_for(req);
    if (!wants(req, n_rows)) {
        stats["reason"] = !req.enabled ? "exact prefill requested" :
                          req.backend_sampling ? "backend sampling: the sampler runs inside the prompt's graph, before RidgeFill's late layers" :
                          n_rows <= p.n_tail ? "no more new prompt rows than the tail" :
                          "fewer new prompt rows than --ridgefill-min-prompt";
        if (req.enabled && req.backend_sampling) {
            LOG_INF("%s: RidgeFill: stock prefill for a prompt of %d new rows: the request samples on the backend "
                    "(backend_sampling), inside the prompt's graph\n", __func__, n_rows);
        }
        return 0;
    }

    if (!is_attached || !rf_same_params(p, attached)) {
        // the request's settings differ from the attached ones: attach them (a setting the context
        // refuses leaves nothing attached; the next plan attaches again)
        if (llama_ridgefill_attach(ctx, maps, p) != 0) {
            error = std::string("\"ridgefill\": ") + llama_ridgefill_last_error();
            is_attached = false;
            return -1;
        }
        attached    = p;
        is_attached = true;
    }

    const int32_t ret = llama_ridgefill_begin(ctx, seq_id, pos0, pos_end);
    if (ret < 0) {
        error = std::string("RidgeFill: ") + llama_ridgefill_last_error();
        return -1;
    }
    if (ret == 0) {
        const std::string why = llama_ridgefill_stock_reason(ctx);
        stats["reason"] = why.empty() ? "stock prefill for this prompt" : why;
    }
    return ret;
}

void server_ridgefill::finish(common_json & stats, double t_prompt_ms, int32_t & n_filled, int32_t & n_exact,
        server_ridgefill_filled & filled) const {
    llama_ridgefill_stats st = {};
    n_filled = 0;
    n_exact  = 0;
    if (!enabled() || llama_ridgefill_get_stats(ctx, &st) != 0 || !st.active) {
        return;
    }
    n_filled = st.n_filled;
    n_exact  = st.n_exact + st.n_tail;

    // the filled rows: the prefix [pos0, pos0 + N - T) but the selected exact rows (ascending)
    std::vector<llama_pos> selected(std::max(0, st.n_exact));
    llama_ridgefill_get_exact(ctx, selected.data(), (int32_t) selected.size());
    filled.keep_before(st.pos0);
    auto sel = selected.begin();
    for (llama_pos p = st.pos0; p < st.pos0 + st.n_prompt - st.n_tail; ++p) {
        if (sel != selected.end() && *sel == p) {
            ++sel;
        } else {
            filled.pos.push_back(p);
        }
    }

    // the keys of Llama.ridgefill_stats (ridgefill_cpp/core/settings.py), and what only the server knows
    stats["applied"]        = true;
    stats["n_prompt"]       = st.n_prompt;
    stats["n_filled"]       = st.n_filled;
    stats["n_exact"]        = st.n_exact;
    stats["tail"]           = st.n_tail;
    stats["split"]          = st.split_layer;
    stats["n_layer"]        = st.n_layer;
    stats["selector"]       = rf_selector_name(attached.selector);
    stats["exact_fraction"] = attached.exact_fraction;
    stats["span"]           = attached.span;
    stats["key_rescale"]    = attached.n_key_rescale;
    stats["probe_rows"]     = st.n_probe;
    stats["ceiling"]        = st.ceiling;
    stats["late_ms"]        = st.t_late_ms;
    stats["prefill_ms"]     = t_prompt_ms;
    stats["maps_bytes"]     = maps ? llama_ridgefill_maps_n_bytes(maps) : 0;

    common_json graphs;
    graphs["early_built"]  = st.n_early_built;
    graphs["early_reused"] = st.n_early_reused;
    graphs["late_built"]   = st.n_late_built;
    graphs["late_reused"]  = st.n_late_reused;
    stats["graphs"] = graphs;

    common_json late_rows;
    late_rows["attention"] = st.n_late_rows;
    late_rows["recurrent"] = st.n_late_rows_recr;
    stats["late_rows"] = late_rows;

    common_json window;
    window["scratch_cells"] = st.n_scratch_cells;
    window["scratch_bytes"] = st.scratch_bytes;
    window["graphs"]        = st.n_window_graphs;
    stats["window"] = window;

    common_json times;
    times["early"]     = st.t_early_ms;
    times["late"]      = st.t_late_ms;
    times["build"]     = st.t_build_ms;
    times["alloc"]     = st.t_alloc_ms;
    times["set_input"] = st.t_set_input_ms;
    times["compute"]   = st.t_compute_ms;
    times["wait"]      = st.t_wait_ms;
    times["other"]     = st.t_other_ms;
    stats["times_ms"] = times;
}

const char * server_ridgefill_no_ui_page() {
    return R"(<!doctype html>
<html lang="en">
<head><meta charset="utf-8"><title>llama-server</title></head>
<body style="font-family: sans-serif; max-width: 42em; margin: 3em auto; padding: 0 1em; line-height: 1.5">
<h1>llama-server</h1>
<p>This llama-server was built without llama.cpp's web UI. Building the UI needs node (20.19 or newer)
and npm; the set-up of ridgefill-cpp said in one line why it left the UI out.</p>
<p>To get the chat page here: install node and npm, then run <code>make native</code> again in the
ridgefill-cpp checkout.</p>
<p>The API works: <code>/v1/chat/completions</code>, <code>/v1/completions</code>, <code>/completion</code>,
<code>/props</code>, <code>/health</code>.</p>
</body>
</html>
)";
}
