// llama_ridgefill_build_info(): what was built, from which llama.cpp, with which patches, and
// what the CPU backend compiled in and uses on this machine.

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

        // the CPU backend: the ISA paths it was compiled with, and the weight buffer types it offers
        // on this machine (AMX only where the CPU has it and the kernel grants the tile state)
        std::string cpu_features = "{";
        std::string cpu_bufts    = "[";
        ggml_backend_reg_t cpu_reg = ggml_backend_reg_by_name("CPU");
        if (cpu_reg) {
            auto get_features = (ggml_backend_get_features_t)
                ggml_backend_reg_get_proc_address(cpu_reg, "ggml_backend_get_features");
            for (auto * f = get_features ? get_features(cpu_reg) : nullptr; f && f->name; ++f) {
                cpu_features += (cpu_features.size() > 1 ? ", " : "") + json_str(f->name) + ": " + json_str(f->value);
            }
            auto get_extra_bufts = (ggml_backend_dev_get_extra_bufts_t)
                ggml_backend_reg_get_proc_address(cpu_reg, "ggml_backend_dev_get_extra_bufts");
            ggml_backend_dev_t cpu_dev = ggml_backend_reg_dev_count(cpu_reg) > 0 ? ggml_backend_reg_dev_get(cpu_reg, 0) : nullptr;
            for (auto * b = get_extra_bufts && cpu_dev ? get_extra_bufts(cpu_dev) : nullptr; b && *b; ++b) {
                cpu_bufts += (cpu_bufts.size() > 1 ? ", " : "") + json_str(ggml_backend_buft_name(*b));
            }
        }
        cpu_features += "}";
        cpu_bufts    += "]";

        std::string s = "{";
        s += "\"ridgefill_version\": " + json_str(LLAMA_RIDGEFILL_VERSION) + ", ";
        s += "\"llama_cpp_commit\": "  + json_str(LLAMA_RIDGEFILL_LLAMA_COMMIT) + ", ";
        s += "\"llama_cpp_python\": "  + json_str(LLAMA_RIDGEFILL_LLAMA_CPP_PYTHON) + ", ";
        s += "\"patchset\": "          + json_str(LLAMA_RIDGEFILL_PATCHSET) + ", ";
        s += "\"build_type\": "        + json_str(LLAMA_RIDGEFILL_BUILD_TYPE) + ", ";
        s += "\"compiler\": "          + json_str(LLAMA_RIDGEFILL_COMPILER) + ", ";
        s += "\"backends\": "          + backends + ", ";
        s += "\"cpu_features\": "      + cpu_features + ", ";
        s += "\"cpu_extra_buffer_types\": " + cpu_bufts;
        s += "}";
        return s;
    }();
    return info.c_str();
}
