#include "llama-ridgefill-error.h"

#include "llama-ridgefill.h"

#include "llama-impl.h"

#include <filesystem>
#include <stdexcept>
#include <system_error>

static thread_local std::string g_ridgefill_last_error;

void llama_ridgefill_set_error(const char * func, const std::string & msg) {
    g_ridgefill_last_error = msg;
    LLAMA_LOG_ERROR("%s: %s\n", func, msg.c_str());
}

void llama_ridgefill_clear_error() {
    g_ridgefill_last_error.clear();
}

const char * llama_ridgefill_last_error(void) {
    return g_ridgefill_last_error.c_str();
}

void llama_ridgefill_check_regular_file(const char * path, const char * what) {
    std::error_code ec;
    const auto st = std::filesystem::status(path, ec);
    if (!ec && std::filesystem::exists(st) && !std::filesystem::is_regular_file(st)) {
        throw std::runtime_error(format("%s: the %s is not a regular file (a FIFO, device or directory)", path, what));
    }
}
