// RidgeFill: faster long-prompt prefill by filling late-layer KV from ridge maps.
// Public C API of the ridgefill-cpp additions to libllama (see docs/design.md §6).
#pragma once

#include "llama.h"

#ifdef __cplusplus
extern "C" {
#endif

    // Build information as a JSON object (static storage, never freed):
    //   ridgefill_version, llama_cpp_commit, llama_cpp_python, patchset, build_type, compiler,
    //   backends (registered ggml backends, e.g. ["CPU"] or ["CUDA", "CPU"])
    LLAMA_API const char * llama_ridgefill_build_info(void);

    // The i-th architecture RidgeFill prefill supports (its GGUF general.architecture name), i from 0;
    // NULL past the last. *hybrid (when not NULL): whether some of its layers are recurrent (Gated
    // DeltaNet), which the late phase runs over every row. Everything else is refused by
    // llama_ridgefill_attach with a message listing these.
    LLAMA_API const char * llama_ridgefill_supported_arch(int32_t i, bool * hybrid);

    //
    // hidden-state capture (calibration, tests): the input of layer il (the residual stream
    // entering it) for every token of the last llama_decode() call, il in [0, n_layer]
    //

    // enable or disable capturing the input of layer il; returns 0, or -1 if il is out of range
    LLAMA_API int32_t llama_ridgefill_capture_layer_input(struct llama_context * ctx, int32_t il, bool enable);

    // float[n_embd * n_tokens] of the last decode call (row-major per token), or NULL when the layer
    // is not captured or nothing was decoded yet; valid until the next decode call
    LLAMA_API const float * llama_ridgefill_get_layer_input(struct llama_context * ctx, int32_t il);

    //
    // maps (docs/design.md §7): the ridge maps of a map file, loaded for one model
    //

    struct llama_ridgefill_maps;

    struct llama_ridgefill_maps_params {
        int32_t      split_layer; // the split S the caller expects, or -1 to take the file's
        bool         host;        // keep the maps in (pinned) host memory, streamed to the accelerator when
                                  // used, instead of with their layer's weights; the same on CPU
        const char * model_path;  // the model's GGUF file: maps fitted on another checkpoint (another
                                  // fingerprint) are refused. NULL: not checked (logged)
    };

    LLAMA_API struct llama_ridgefill_maps_params llama_ridgefill_maps_default_params(void);

    // load the maps of a map file and check them against the model: file type and format version,
    // architecture, n_layer, n_embd, split, the range of every number in its metadata (an
    // input_norm_eps in [0, LLAMA_RIDGEFILL_MAX_NORM_EPS]), the list of mapped layers, tensor names,
    // shapes, types, each tensor's content digest (ridgefill.digest.xxh64, XXH64 of its bytes; a file
    // without one is refused unless LLAMA_RIDGEFILL_ALLOW_UNDIGESTED=1) and finite values, and with
    // params.model_path the fingerprint of the model file the maps were fitted on. Returns NULL on any mismatch; llama_ridgefill_last_error() says
    // what did not match, naming the key or the tensor.
    LLAMA_API struct llama_ridgefill_maps * llama_ridgefill_maps_init(
            const struct llama_model * model,
                          const char * path,
     struct llama_ridgefill_maps_params params);

    // the fingerprint of a model GGUF file as map files record it ("sha256:" and 32 hex digits: the
    // architecture, the tensor layout and about a megabyte of sampled tensor bytes), written to buf
    // (NUL-terminated, cut at buf_size). Returns its length, or -1 (see llama_ridgefill_last_error)
    LLAMA_API int32_t llama_ridgefill_model_fingerprint(const char * model_path, char * buf, size_t buf_size);

    LLAMA_API void        llama_ridgefill_maps_free       (struct llama_ridgefill_maps * maps);
    LLAMA_API int32_t     llama_ridgefill_maps_split_layer(const struct llama_ridgefill_maps * maps);
    LLAMA_API const char * llama_ridgefill_maps_fingerprint(const struct llama_ridgefill_maps * maps);
    LLAMA_API uint64_t    llama_ridgefill_maps_n_bytes    (const struct llama_ridgefill_maps * maps);

    // where the maps live: the buffer type names of their buffers, comma-separated (e.g. "CPU",
    // "CUDA0", "CUDA_Host"); static storage per maps object, valid while it lives
    LLAMA_API const char * llama_ridgefill_maps_buffer_types(const struct llama_ridgefill_maps * maps);

    // the largest RMS-norm epsilon a map file may record (models use 1e-6 .. 1e-5)
    #define LLAMA_RIDGEFILL_MAX_NORM_EPS 1e-2f

    // whether every tensor was checked against the file's content digest (false: the file has none and
    // was loaded with LLAMA_RIDGEFILL_ALLOW_UNDIGESTED=1; without it such a file is refused)
    LLAMA_API bool        llama_ridgefill_maps_digest_checked(const struct llama_ridgefill_maps * maps);

    // whether the maps were loaded for host placement (llama_ridgefill_maps_params.host)
    LLAMA_API bool        llama_ridgefill_maps_host       (const struct llama_ridgefill_maps * maps);

    // the storage type of the map matrices ("f32", "f16", "q8_0", "q4_0", "q4_k") and the map form
    // ("full"; "identity_low_rank": A = I + U V^T; "low_rank": A = U V^T)
    LLAMA_API const char * llama_ridgefill_maps_type      (const struct llama_ridgefill_maps * maps);
    LLAMA_API const char * llama_ridgefill_maps_form      (const struct llama_ridgefill_maps * maps);

    // the predicted input of layer il for n_rows split-layer states xs ([n_rows][n_embd], row-major):
    // x_hat = A_il phi(xs) + b_il, or xs itself for il == S; computed on the CPU backend with the same
    // graph step the fill uses. For tests and tools. Returns 0, or -1 (see llama_ridgefill_last_error)
    LLAMA_API int32_t llama_ridgefill_maps_predict(
            const struct llama_ridgefill_maps * maps,
                                    int32_t   il,
                                const float * xs,
                                    int32_t   n_rows,
                                      float * out);

    //
    // filled-row prefill (docs/design.md §4-§6): RidgeFill attached to a context, one planned prompt at a time
    //

    enum llama_ridgefill_selector {
        LLAMA_RIDGEFILL_SELECTOR_NONE      = 0, // no exact prefix rows
        LLAMA_RIDGEFILL_SELECTOR_ATTENTION = 1, // the rows the last prompt rows attend to most, below S
        LLAMA_RIDGEFILL_SELECTOR_PROBE     = 2, // the same score at the late layers: the tail runs the late
                                                //   layers against the filled cache first (a probe pass)
        LLAMA_RIDGEFILL_SELECTOR_PROTECTED = 3, // rows of a token class (protected_classes), no attention
        LLAMA_RIDGEFILL_SELECTOR_ATTENTION_PROTECTED = 4, // the protected rows, then the attention
                                                          //   selector's rows up to the fraction
    };

    // row classes of the protected selector (a bit mask); a row is protected when it is in any of
    // the classes. Rows of a prompt given as embeddings have no token: only the sink class applies.
    enum llama_ridgefill_token_class {
        LLAMA_RIDGEFILL_CLASS_DIGIT      = 1, // the token's text has a decimal digit
        LLAMA_RIDGEFILL_CLASS_RARE       = 2, // the token occurs once in the prompt
        LLAMA_RIDGEFILL_CLASS_LINE_START = 4, // the token follows a newline
        LLAMA_RIDGEFILL_CLASS_SINK       = 8, // the first LLAMA_RIDGEFILL_N_SINK positions of the sequence
    };

    // the attention-sink rows of the sink class: positions 0 .. LLAMA_RIDGEFILL_N_SINK-1
    #define LLAMA_RIDGEFILL_N_SINK 4

    // the longest span of the attention and probe selectors (llama_ridgefill_params.span)
    #define LLAMA_RIDGEFILL_MAX_SPAN 4096

    // span > 1: the share of a scored selector's exact rows that come as whole spans (the spans of the
    // top-scoring rows, in score order); the rest are the top-scoring single rows not yet taken
    #define LLAMA_RIDGEFILL_SPAN_SHARE 0.75

    // the attention selectors: the share of the exact rows taken first by their recency-corrected
    // score (llama_ridgefill_recency_corrected), as spans (part of LLAMA_RIDGEFILL_SPAN_SHARE), before
    // the rows by score as measured. The query rows attend mostly to the rows just before them; this
    // share goes to the rows that stand out against that trend (a fact far back that the question
    // asks about)
    #define LLAMA_RIDGEFILL_RECENCY_SHARE 0.25

    // the steepest recency trend the correction removes: score ~ distance^-2
    #define LLAMA_RIDGEFILL_RECENCY_MAX_SLOPE 2.0

    // diagnostics (the splice test of docs/design.md §9): filled rows keep the K and/or V already in their
    // cells instead of writing the fill's. With a cache holding the exact prefill of the same prompt in
    // the same cells (llama_memory_clear(mem, false) between the two prefills), this replaces the
    // filled K or V of the late layers with the exact one.
    enum llama_ridgefill_splice {
        LLAMA_RIDGEFILL_SPLICE_NONE = 0,
        LLAMA_RIDGEFILL_SPLICE_K    = 1,
        LLAMA_RIDGEFILL_SPLICE_V    = 2,
        LLAMA_RIDGEFILL_SPLICE_KV   = 3,
    };

    // the terminal-state correction of recurrent (Gated DeltaNet) late layers (docs/design.md §4.4): how each
    // late recurrent layer's state is adjusted at the prefix/tail boundary, before the tail runs
    enum llama_ridgefill_state_correction {
        LLAMA_RIDGEFILL_STATE_CORRECTION_NONE = 0, // the state the filled rows left
        LLAMA_RIDGEFILL_STATE_CORRECTION_GAIN = 1, // times a per-value-head gain fitted in closed form on
                                                   //   calibration text (the map file's state gains)
    };

    struct llama_ridgefill_params {
        int32_t split_layer;    // S, 1 <= S <= n_layer (S = n_layer: stock); -1: the maps' split
        int32_t n_tail;         // T >= 1: the last T prompt rows are exact (tunable)
        double  exact_fraction; // share of the prefix rows the selector keeps exact, in [0, 1] (tunable)
        int32_t selector;       // enum llama_ridgefill_selector (tunable)
        int32_t n_sel_queries;  // attention selector: query rows (the last prompt rows), >= 1
        int32_t sel_layer;      // attention selector: layer below S to score at; -1: the last
                                //   full-attention layer below S
        int32_t n_rescale;      // c: value-scale rows (first min(c, T) tail rows); 0: no value scale
        int32_t min_prompt;     // prompts of fewer rows run stock prefill
        int32_t n_fill_chunk;   // filled rows per fill step; 0: n_ubatch
        int32_t splice;         // enum llama_ridgefill_splice (diagnostics; NONE in normal use)
        int32_t n_key_rescale;  // c_K: tail rows a per-head key scale is measured on, applied to the
                                //   filled K like the value scale to V (0: off, the default) (tunable)
        int32_t protected_classes; // protected selector: enum llama_ridgefill_token_class bits; at most
                                   //   ceil(exact_fraction * prefix) rows: sink rows first, then digits,
                                   //   then rarer tokens, then line starts
        int32_t state_correction;  // enum llama_ridgefill_state_correction (recurrent late layers; GAIN
                                   //   needs maps with state gains)
        int32_t span;              // attention and probe selectors: rows are taken by the highest score
                                   //   within the span of `span` rows around them, so the rows around
                                   //   each top-scoring row stay exact together (default 16); 1:
                                   //   single rows; at most LLAMA_RIDGEFILL_MAX_SPAN (tunable)
    };

    // The fields `ridgefill-gguf tune` chooses for a map file - n_tail, exact_fraction, selector, span
    // and n_key_rescale - may be left unset (LLAMA_RIDGEFILL_UNSET, as llama_ridgefill_default_params()
    // leaves them): an unset field takes the map file's tuned value (its ridgefill.tuned.* keys) when
    // the maps have one, else its built-in value (llama_ridgefill_builtin_params()). An explicit value
    // always wins.
    #define LLAMA_RIDGEFILL_UNSET (-1)

    // the tunable fields as bits of a mask: which fields came from the map file
    enum llama_ridgefill_tunable {
        LLAMA_RIDGEFILL_TUNABLE_TAIL           = 1,  // n_tail
        LLAMA_RIDGEFILL_TUNABLE_EXACT_FRACTION = 2,  // exact_fraction
        LLAMA_RIDGEFILL_TUNABLE_SELECTOR       = 4,  // selector
        LLAMA_RIDGEFILL_TUNABLE_SPAN           = 8,  // span
        LLAMA_RIDGEFILL_TUNABLE_KEY_RESCALE    = 16, // n_key_rescale
    };

    // the defaults: the tunable fields unset, every other field at its built-in value
    LLAMA_API struct llama_ridgefill_params llama_ridgefill_default_params(void);

    // every field at its built-in value (what an unset tunable field runs with without a tuned value)
    LLAMA_API struct llama_ridgefill_params llama_ridgefill_builtin_params(void);

    // fill the unset tunable fields of params as llama_ridgefill_attach() will: from the tuned operating
    // point of the map file at maps_path (NULL: none), else the built-in values; the metadata only is
    // read. Returns the enum llama_ridgefill_tunable bits of the fields taken from the file, or -1
    // (llama_ridgefill_last_error: an unreadable file, a tuned value of the wrong type or out of range)
    LLAMA_API int32_t llama_ridgefill_resolve_params(const char * maps_path, struct llama_ridgefill_params * params);

    // the selectors by name ("none", "attention", "probe", "protected", "attention+protected"):
    // the name of an enum llama_ridgefill_selector value (NULL: none), and the value of a name (-1: none)
    LLAMA_API const char * llama_ridgefill_selector_name     (int32_t selector);
    LLAMA_API int32_t      llama_ridgefill_selector_from_name(const char * name);

    // every selector name in enum order, comma-separated ("none, attention, ..."; for help texts)
    LLAMA_API const char * llama_ridgefill_selector_names(void);

    // attach RidgeFill to a context (replacing any attached before): maps NULL is identity fill at
    // params.split_layer. The maps must outlive the attachment. Allocates the per-row scratch (x_S
    // and the exact rows' states, n_embd * n_ctx floats each). Returns 0, or -1 with
    // llama_ridgefill_last_error() saying why (unsupported architecture or context settings,
    // parameters out of range, maps of another model or split) - the context is unchanged then.
    LLAMA_API int32_t llama_ridgefill_attach(
            struct llama_context * ctx,
      const struct llama_ridgefill_maps * maps,
     struct llama_ridgefill_params params);

    LLAMA_API void llama_ridgefill_detach(struct llama_context * ctx);

    // the settings attached to ctx, resolved (split_layer: the maps' split when -1 was given; the
    // tunable fields from the map file or built in); returns the enum llama_ridgefill_tunable bits of
    // the fields that came from the map file, or -1 without RidgeFill attached
    LLAMA_API int32_t llama_ridgefill_get_params(const struct llama_context * ctx, struct llama_ridgefill_params * out);

    // plan the prompt rows [pos0, pos_end) of seq_id: the next llama_decode() calls bring these rows
    // (in any chunks, in order, no other rows in the same batch); their early layers run there, and
    // the call that brings row pos_end-1 runs the late layers and writes the logits of the tail rows
    // it brings that ask for them (docs/design.md §4.5); logits asked for any other planned row are NaN.
    // Returns 1 when planned, 0 when the prompt runs stock (S = n_layer, N <= T, N < min_prompt),
    // -1 on error (no RidgeFill attached, a plan in progress, rows out of the context).
    LLAMA_API int32_t llama_ridgefill_begin(struct llama_context * ctx, llama_seq_id seq_id, llama_pos pos0, llama_pos pos_end);

    // why the last llama_ridgefill_begin() on ctx returned 0 (the prompt runs stock prefill), in words
    // for a user; "" after a begin that planned or failed, or without RidgeFill attached
    LLAMA_API const char * llama_ridgefill_stock_reason(const struct llama_context * ctx);

    // fix the exact prefix rows of the current plan (absolute positions in [pos0, pos_end - T)),
    // overriding the selector; before the rows are decoded. Returns 0 or -1.
    LLAMA_API int32_t llama_ridgefill_set_exact(struct llama_context * ctx, const llama_pos * pos, int32_t n);

    // drop the current plan (rows already decoded keep only their early layers: remove them)
    LLAMA_API void llama_ridgefill_cancel(struct llama_context * ctx);

    struct llama_ridgefill_stats {
        int32_t   active;        // 1: the last planned prompt ran RidgeFill prefill; 0: none yet
        llama_seq_id seq_id;
        llama_pos pos0;          // first planned position
        int32_t   n_prompt;      // N
        int32_t   n_layer;
        int32_t   split_layer;   // S
        int32_t   n_tail;        // min(T, N)
        int32_t   n_exact;       // selected exact prefix rows |E|
        int32_t   n_filled;      // N - T - |E|
        int32_t   sel_layer;     // layer the attention selector scored at, -1: none (probe: every
                                 //   full-attention late layer; reported as the split)
        int32_t   n_scale_rows;  // min(c, T)
        float     ceiling;       // 1/r, r = S/L + (1 - S/L)(T + |E| + probe rows)/N
        int32_t   n_probe;       // rows of the probe pass (selector probe: T), 0 otherwise
        double    t_late_ms;     // the late phase (selection, fill, exact rows)

        // the graphs of the plan: early phase (the ubatches of its rows; built anew, or reused as
        // llama.cpp reuses a previous ubatch's graph) and late phase
        int32_t   n_early_built;
        int32_t   n_early_reused;
        int32_t   n_late_built;
        int32_t   n_late_reused;
        // where the plan's time went (ms): the early phase (its ubatches: graph, inputs, launch and,
        // where the backend computes synchronously, compute; then the wait for its last graphs when
        // the late phase starts, the rest of its compute); within the late phase its graphs' build,
        // alloc, set_input, compute (launch, and compute where synchronous) and wait (for results read
        // back); other = t_late_ms minus those five (selection, cells, memory contexts, read-backs)
        double    t_early_ms;
        double    t_build_ms;
        double    t_alloc_ms;
        double    t_set_input_ms;
        double    t_compute_ms;
        double    t_wait_ms;
        double    t_other_ms;

        // rows of a late graph: exact rows of an attention layer's chunk (n_ubatch), and rows of a
        // recurrent layer's chunk (at most n_ubatch of them exact; up to 8 n_ubatch where the compute
        // buffers hold them)
        int32_t   n_late_rows;
        int32_t   n_late_rows_recr;

        // a window-sized sliding-window cache (swa_full off): the late sliding-window layers of exact rows
        // whose windows reach rows the cache no longer holds run over a scratch cache of n_scratch_cells
        // cells (n_swa + 2 n_ubatch, padded; scratch_bytes for every late sliding-window layer), in
        // n_window_graphs graphs of the late phase; 0 when the context has no such cache
        int32_t   n_scratch_cells;
        int32_t   n_window_graphs;
        int64_t   scratch_bytes;

        // 1: the plan's graphs computed their KQ masks from the cells' positions (by default where the
        // KV cache is in device memory; LLAMA_RIDGEFILL_GRAPH_MASK=0/1), 0: llama.cpp's host-built masks
        int32_t   graph_kq_mask;
    };

    // statistics of the last finished plan; returns 0, or -1 without RidgeFill attached
    LLAMA_API int32_t llama_ridgefill_get_stats(struct llama_context * ctx, struct llama_ridgefill_stats * out);

    // the selected exact prefix positions of the last finished plan, ascending: copies up to n,
    // returns how many there are
    LLAMA_API int32_t llama_ridgefill_get_exact(struct llama_context * ctx, llama_pos * out, int32_t n);

    // the attention selector's scores of the last finished plan for positions pos0..pos_end-1:
    // copies up to n, returns how many there are (0 when no scores were measured)
    LLAMA_API int32_t llama_ridgefill_get_scores(struct llama_context * ctx, float * out, int32_t n);

    // the value scales s_{l,h} of the last finished plan, [n_layer - S][n_head_kv] row-major
    // (1 where not measured): copies up to n, returns how many there are
    LLAMA_API int32_t llama_ridgefill_get_value_scales(struct llama_context * ctx, float * out, int32_t n);

    // the key scales of the last finished plan, [n_layer - S][n_head_kv] (1 where not measured)
    LLAMA_API int32_t llama_ridgefill_get_key_scales(struct llama_context * ctx, float * out, int32_t n);

    // copy the K and V cache rows of layer il for positions pos[0..n) of seq_id as F32, [n][n_embd_k_gqa]
    // and [n][n_embd_v_gqa] (either output may be NULL). For tests and tools. Returns 0 or -1.
    LLAMA_API int32_t llama_ridgefill_read_kv(
            struct llama_context * ctx,
                         int32_t   il,
                    llama_seq_id   seq_id,
                 const llama_pos * pos,
                         int32_t   n,
                           float * k_out,
                           float * v_out);

    // hybrid models: the recurrent state of layer il for seq_id as F32, the conv state then the ssm state
    // (the layout of llama.cpp's recurrent memory). Copies up to n floats, returns how many there are,
    // or -1 (not a recurrent layer, no such sequence). For tests and tools.
    LLAMA_API int32_t llama_ridgefill_read_state(
            struct llama_context * ctx,
                         int32_t   il,
                    llama_seq_id   seq_id,
                           float * out,
                         int32_t   n);

    // hybrid models: record, in the next plans, each late recurrent layer's state after the last prefix
    // row, before any terminal-state correction (what the correction's gains are fitted on)
    LLAMA_API void llama_ridgefill_record_boundary_states(struct llama_context * ctx, bool record);

    // the recorded boundary state of late recurrent layer il of the last finished plan, in the layout of
    // llama_ridgefill_read_state: copies up to n floats, returns how many there are (0: none recorded),
    // -1 without RidgeFill attached
    LLAMA_API int32_t llama_ridgefill_get_boundary_state(struct llama_context * ctx, int32_t il, float * out, int32_t n);

    // diagnostics (the splice test of docs/design.md §9 for recurrent state): in the next plans, late recurrent
    // layer il starts its tail rows from `state` (n floats in the layout of llama_ridgefill_read_state,
    // e.g. read after an exact prefill of the prompt's prefix) instead of the state its filled rows
    // left, before any terminal-state correction. state NULL: no layer is spliced any more.
    // Returns 0, or -1 (not a late recurrent layer of this context, wrong size).
    LLAMA_API int32_t llama_ridgefill_splice_state(struct llama_context * ctx, int32_t il, const float * state, int32_t n);

    // whether the maps carry state gains for the terminal-state correction
    LLAMA_API bool llama_ridgefill_maps_has_state_gains(const struct llama_ridgefill_maps * maps);

    // the message of the last failed RidgeFill call on this thread ("" after a success)
    LLAMA_API const char * llama_ridgefill_last_error(void);

    //
    // several machines: llama.cpp's RPC backend (ggml-rpc-server workers, docs/design.md §6.5)
    //

    // The devices a model split over the RPC servers `servers` ("host:port[,host:port...]") uses,
    // for llama_model_params.devices, in the order llama.cpp's --rpc gives them: the servers'
    // devices in the order listed, then this machine's GPUs (the CPU needs no entry). Connects to
    // each server. Writes at most n_max devices to devs, NULL-terminated when there is room; returns
    // how many there are, or -1 (malformed list, a server that does not answer, no RPC backend).
    LLAMA_API int32_t llama_ridgefill_rpc_devices(const char * servers, ggml_backend_dev_t * devs, int32_t n_max);

    // The RPC servers (comma-separated host:port) of the model's devices whose connection failed:
    // the model's tensors there are lost, so every later decode fails until the model is loaded again
    // once they are back. "" when none (or the model uses no RPC device). Valid until the next call
    // on this thread.
    LLAMA_API const char * llama_ridgefill_lost_rpc_servers(const struct llama_model * model);

    // The device layer il of the model lives on, "NAME (DESCRIPTION)": "CPU (...)", "RPC0 (host:port)",
    // "CUDA0 (...)"; NULL for il out of [0, n_layer). Valid until the next call on this thread.
    LLAMA_API const char * llama_ridgefill_layer_device(const struct llama_model * model, int32_t il);

#ifdef __cplusplus
}
#endif
