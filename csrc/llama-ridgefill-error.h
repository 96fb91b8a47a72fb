// The error reporting of RidgeFill's C API (llama_ridgefill_last_error) and the file checks every
// reader shares. Its own unit, so the maps loader, the fingerprint and the context depend on it and
// not on one another.

#pragma once

#include <string>

// record the message of a failed call for llama_ridgefill_last_error() and log it
void llama_ridgefill_set_error(const char * func, const std::string & msg);

// a call succeeded: llama_ridgefill_last_error() returns ""
void llama_ridgefill_clear_error();

// throws when path names something other than a regular file (or a link to one): a FIFO or a
// device would block or stream, a directory fail with a less clear message. A missing file is left
// to the reader's own message. what: "model", "map file"
void llama_ridgefill_check_regular_file(const char * path, const char * what);
