// RidgeFill in llama-server (ridgefill-cpp): the --ridgefill-* settings, the per-request "ridgefill"
// field and the RidgeFill attached to the server's target context. Compiled into llama.cpp's
// server-context library; the hooks in tools/server are patches/0007-server-ridgefill.patch.
//
// Planned prompts are serialised. llama_ridgefill_begin() needs the rows of one sequence alone in
// the decode calls up to the plan's last row (its late phase runs then), so while a slot's planned
// prompt is in progress - or a slot is about to start one - the server's batch holds that slot's
// prompt rows only: other slots' generation and prompts wait for those decode calls (server_ridgefill
// ::owner). Planned prompts of several slots run one after the other; generation resumes in between.
//
// Prompt cache. The late-layer KV of a planned prompt's filled rows is approximate, and so is
// everything decoded after them. server_prompt::n_exact counts the leading cached tokens whose KV is
// exact (INT32_MAX: all). A request that is exact - "ridgefill": false, or a server without RidgeFill
// maps - drops the approximate part before it looks for a common prefix, so it never reuses
// approximate KV; a RidgeFill request reuses the whole cached prefix (it accepted the approximation).
// The host-memory prompt cache (--cache-ram) keeps n_exact with each saved prompt. Context
// checkpoints are not created during a planned prompt (they would capture half-finished late layers).

#pragma once

#include "common.h"
#include "json.h"
#include "llama-ridgefill.h"

#include <cstdint>
#include <string>
#include <vector>

// the "ridgefill" field of one request
struct server_ridgefill_request {
    bool    enabled        = true; // false: exact prefill for this request
    int32_t n_tail         = -1;   // -1: the server's --ridgefill-tail
    double  exact_fraction = -1.0; // < 0: the server's --ridgefill-exact-fraction
    int32_t selector       = -1;   // enum llama_ridgefill_selector, -1: the server's --ridgefill-selector
    int32_t span           = -1;   // -1: the server's --ridgefill-span

    // set by the server, not the client: the request samples inside the graph (backend sampling),
    // from the last ubatch's logits before a plan's late layers have run, so its prompt runs stock
    bool    backend_sampling = false;
};

// The rows of a slot's cached prompt whose late-layer KV RidgeFill filled, by position (ascending): a
// later prompt that reuses the cache reports how many of the rows it reused were filled
// (server_ridgefill::begin). Kept with the prompt as server_prompt::n_exact is.
struct server_ridgefill_filled {
    std::vector<llama_pos> pos;

    // filled rows at positions before p
    int32_t count_before(llama_pos p) const;

    // the cache keeps the rows before position p only
    void keep_before(llama_pos p);

    // a context shift: the n rows from position p0 leave the cache, the rows after them move down by n
    void discard(llama_pos p0, int32_t n);
};

// parse the value of a request's "ridgefill" member: false, true, or an object with any of "tail"
// (integer >= 1), "exact_fraction" (number in [0, 1]), "selector" (a selector name) and "span"
// (integer in 1..LLAMA_RIDGEFILL_MAX_SPAN). Throws
// std::invalid_argument saying what is wrong. enabled_on_server: false when the server runs without
// RidgeFill, where only false is accepted.
server_ridgefill_request server_ridgefill_parse_request(const common_json & value, bool enabled_on_server);

// whether the server's command line asks for RidgeFill
bool server_ridgefill_configured(const common_params_ridgefill & params);

// the command line's RidgeFill settings as libllama parameters: the flags given, the rest unset
// (llama_ridgefill_default_params: the map file's tuned values, else the built-in ones, once
// attached); false with the reason in error for an unknown selector name
bool server_ridgefill_to_params(const common_params_ridgefill & params, llama_ridgefill_params & out, std::string & error);

// An embeddings or reranking server (--embedding, --reranking) pools every layer of every prompt
// row, which a plan does not compute: RidgeFill is off for it. With embedding and RidgeFill
// configured, clears params and returns the line to log once; "" otherwise
std::string server_ridgefill_disable_for_embeddings(common_params_ridgefill & params, bool embedding);

// The KV cache of several slots: as on stock llama-server. Without --kv-unified each slot has its own
// KV stream of n_ctx / n_parallel cells, and a planned prompt fills and runs its slot's stream.
// With --kv-unified from the user, the slots share all cells, and a prompt starts only when its
// rows fit next to the rows the running slots hold and will still write.
struct server_ridgefill_slot_cells {
    bool    running; // processing a prompt or generating
    int64_t n_rows;  // cells it holds (a running slot: its whole prompt, written or not)
    int64_t n_rest;  // cells it may still write (the rest of a bounded n_predict)
};

enum server_ridgefill_admission {
    SERVER_RIDGEFILL_ADMIT,             // fits now
    SERVER_RIDGEFILL_ADMIT_AFTER_PURGE, // fits once the caches of the slots that are not running are cleared
    SERVER_RIDGEFILL_WAIT,              // the running slots need the room: try again later
};

// a prompt needing n_need cells (its rows and bounded n_predict), next to the other slots
server_ridgefill_admission server_ridgefill_admit(int64_t n_ctx, int64_t n_need,
        const std::vector<server_ridgefill_slot_cells> & others);

// the page at "/" of a llama-server built without llama.cpp's web UI (tools/build_ui.py found no
// node and npm): what is missing and how to get it, instead of a JSON 404
const char * server_ridgefill_no_ui_page();

struct server_ridgefill {
    server_ridgefill() = default;
    server_ridgefill(const server_ridgefill &) = delete;
    server_ridgefill & operator=(const server_ridgefill &) = delete;
    ~server_ridgefill();

    // load the maps (if any; checked against the model file at model_path) and attach RidgeFill to
    // ctx with the command line's settings; false with the reason in error. Nothing to do when the
    // command line has no RidgeFill.
    bool init(const common_params_ridgefill & params, const std::string & model_path, llama_model * model,
              llama_context * ctx, std::string & error);

    bool enabled() const { return ctx != nullptr; }

    // the settings the server runs requests with, for GET /props (maps, split, tail, exact_fraction,
    // selector, span, key_rescale, min_prompt): resolved once, when RidgeFill was attached - the command
    // line's, else the tuned values of the maps in memory, else the built-in ones - so a map file changed
    // or moved afterwards changes nothing here, as it changes nothing in the requests; null without
    // RidgeFill
    common_json props() const;

    // the request's prefill is exact: no RidgeFill on the server, or switched off for the request
    bool exact(const server_ridgefill_request & req) const { return !enabled() || !req.enabled; }

    // whether a prompt of n_rows new rows would be planned for the request
    bool wants(const server_ridgefill_request & req, int32_t n_rows) const;

    // plan the prompt rows [pos0, pos_end) of seq_id with the request's settings (re-attaching
    // RidgeFill when they differ from the attached ones): 1 planned, 0 stock prefill (short prompt,
    // exact request, ...: stats["reason"] says why), -1 error (in error). Fills stats with what a
    // response reports; a prompt that reused n_cached rows of the slot's cache before pos0 (`filled`:
    // which of them RidgeFill filled) reports n_cached and n_cached_filled.
    int32_t begin(const server_ridgefill_request & req, llama_seq_id seq_id, llama_pos pos0, llama_pos pos_end,
            int32_t n_cached, const server_ridgefill_filled & filled, common_json & stats, std::string & error);

    // the planned prompt's rows were decoded: adds llama_ridgefill_get_stats() of the finished plan
    // and the prompt time to stats, and the plan's filled rows to `filled`; returns the filled and
    // exact (selected + tail) row counts
    void finish(common_json & stats, double t_prompt_ms, int32_t & n_filled, int32_t & n_exact,
            server_ridgefill_filled & filled) const;

private:
    llama_ridgefill_params params_for(const server_ridgefill_request & req) const;

    llama_context        * ctx  = nullptr;
    llama_ridgefill_maps * maps = nullptr;
    std::string            maps_path; // --ridgefill-maps ("" for identity fill)

    llama_ridgefill_params defaults = {}; // the command line's, resolved as attached
    llama_ridgefill_params attached = {}; // attached now
    bool                   is_attached = false;
};
