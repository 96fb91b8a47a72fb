// llama_ridgefill_build_info(): what was built, from which llama.cpp, with which patches.

#include "llama-ridgefill.h"
#include "llama-ridgefill-build-config.h"

#include "ggml-backend.h"

#include <string>

static std::string json_str(const char * s) {
    std::string out = "\"";
    for (const char * p = s; *p; ++p) {
        switch (*p) {
            case '"':  out += "\\\""; break;
            case '\\': out += "\\\\"; break;
            case '\n': out += "\\n";  break;
            default:   out += *p;     break;
        }
    }
    return out + "\"";
}

const char * llama_ridgefill_build_info(void) {
    static const std::string info = [] {
        std::string backends = "[";
        for (size_t i = 0; i < ggml_backend_reg_count(); ++i) {
            if (i > 0) {
                backends += ", ";
            }
            backends += json_str(ggml_backend_reg_name(ggml_backend_reg_get(i)));
        }
        backends += "]";

        std::string s = "{";
        s += "\"ridgefill_version\": " + json_str(LLAMA_RIDGEFILL_VERSION) + ", ";
        s += "\"llama_cpp_commit\": "  + json_str(LLAMA_RIDGEFILL_LLAMA_COMMIT) + ", ";
        s += "\"llama_cpp_python\": "  + json_str(LLAMA_RIDGEFILL_LLAMA_CPP_PYTHON) + ", ";
        s += "\"patchset\": "          + json_str(LLAMA_RIDGEFILL_PATCHSET) + ", ";
        s += "\"build_type\": "        + json_str(LLAMA_RIDGEFILL_BUILD_TYPE) + ", ";
        s += "\"compiler\": "          + json_str(LLAMA_RIDGEFILL_COMPILER) + ", ";
        s += "\"backends\": "          + backends;
        s += "}";
        return s;
    }();
    return info.c_str();
}
