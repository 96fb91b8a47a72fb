// The fingerprint of a model GGUF file, as map files record it (llama_ridgefill_model_fingerprint).

#pragma once

#include <string>

// the fingerprint of the model GGUF at path; throws with a message naming the file when it cannot
// be read
std::string llama_ridgefill_model_fingerprint_file(const char * path);
