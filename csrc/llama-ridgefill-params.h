// RidgeFill's settings: the built-in value of every field of llama_ridgefill_params, the selector
// names, and the operating point `ridgefill-gguf tune` writes into a map file (ridgefill.tuned.*),
// which fills the tunable fields a caller leaves unset. The one source of these values: Python's
// RidgeFill, llama-server's flags and help texts and any C caller read them from here.

#pragma once

#include "llama-ridgefill.h"

#include <cstdint>
#include <string>

struct gguf_context;

// the tuned operating point of a map file, as stored (its ranges are checked where a value applies)
struct llama_ridgefill_tuned {
    int32_t     has            = 0;   // enum llama_ridgefill_tunable bits: the keys the file has
    int64_t     n_tail         = 0;
    double      exact_fraction = 0.0;
    std::string selector;
    int64_t     span           = 0;
    int64_t     n_key_rescale  = 0;
};

// the ridgefill.tuned.* values of a map file's metadata (none: has == 0); throws naming path and the
// key when one of them has the wrong type
llama_ridgefill_tuned llama_ridgefill_read_tuned(const gguf_context * ctx, const std::string & path);

// fill the unset tunable fields of params from tuned (nullptr: none), else from the built-in values;
// returns the enum llama_ridgefill_tunable bits of the fields taken from tuned. Throws naming path and
// the key when a value it takes is out of range.
int32_t llama_ridgefill_apply_tuned(const llama_ridgefill_tuned * tuned, const std::string & path,
        llama_ridgefill_params & params);
