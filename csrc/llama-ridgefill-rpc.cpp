// A model split over machines with llama.cpp's RPC backend (ggml-rpc-server workers): the devices
// of a list of servers for llama_model_params.devices, and which servers a model has lost.
// RidgeFill's graphs need nothing else: they are ggml operators, serialised to the workers like
// any other graph (docs/design.md §6.5).

#include "llama-ridgefill.h"
#include "llama-ridgefill-context.h"
#include "llama-ridgefill-error.h"
#include "llama-ridgefill-maps.h"

#include "llama-impl.h"
#include "llama-model.h"

#include "ggml-backend.h"

#include <string>
#include <vector>

namespace {

ggml_backend_reg_t rpc_reg() {
    return ggml_backend_reg_by_name("RPC");
}

bool is_rpc_dev(ggml_backend_dev_t dev) {
    ggml_backend_reg_t reg = rpc_reg();
    return reg != nullptr && dev != nullptr && ggml_backend_dev_backend_reg(dev) == reg;
}

} // namespace

bool llama_ridgefill_uses_rpc(const llama_model & model) {
    for (const auto & d : model.devices) {
        if (!d.is_meta && is_rpc_dev(d.dev)) {
            return true;
        }
    }
    return false;
}

std::string llama_ridgefill_lost_servers(const llama_model & model) {
    ggml_backend_reg_t reg = rpc_reg();
    if (reg == nullptr) {
        return "";
    }
    // patches/0009: true once the connection to the device's server failed
    typedef bool (*dev_lost_t)(ggml_backend_dev_t dev);
    auto dev_lost = (dev_lost_t) ggml_backend_reg_get_proc_address(reg, "ggml_backend_rpc_dev_lost");
    std::string lost;
    for (const auto & d : model.devices) {
        if (!d.is_meta && is_rpc_dev(d.dev) && dev_lost != nullptr && dev_lost(d.dev)) {
            const std::string endpoint = ggml_backend_dev_description(d.dev);
            if (lost.find(endpoint) == std::string::npos) {
                lost += (lost.empty() ? "" : ",") + endpoint;
            }
        }
    }
    return lost;
}

int32_t llama_ridgefill_rpc_devices(const char * servers, ggml_backend_dev_t * devs, int32_t n_max) {
    llama_ridgefill_clear_error();
    ggml_backend_reg_t reg = rpc_reg();
    if (reg == nullptr) {
        llama_ridgefill_set_error(__func__, "this build has no RPC backend (GGML_RPC)");
        return -1;
    }
    typedef ggml_backend_reg_t (*add_server_t)(const char * endpoint);
    auto add_server = (add_server_t) ggml_backend_reg_get_proc_address(reg, "ggml_backend_rpc_add_server");
    GGML_ASSERT(add_server != nullptr);

    std::vector<ggml_backend_dev_t> out;
    const std::string list = servers ? servers : "";
    size_t start = 0;
    while (start <= list.size()) {
        const size_t end = std::min(list.find(',', start), list.size());
        const std::string endpoint = list.substr(start, end - start);
        const size_t colon = endpoint.rfind(':');
        if (endpoint.empty() || colon == std::string::npos || colon == 0 || colon + 1 == endpoint.size() ||
                endpoint.find_first_not_of("0123456789", colon + 1) != std::string::npos) {
            llama_ridgefill_set_error(__func__, format("'%s' is not a host:port RPC server (in '%s')", endpoint.c_str(), list.c_str()));
            return -1;
        }
        // connects and asks for the server's devices; nullptr when it does not answer
        ggml_backend_reg_t server = add_server(endpoint.c_str());
        if (server == nullptr) {
            llama_ridgefill_set_error(__func__, format("RPC server %s does not answer (is ggml-rpc-server running there, "
                    "from the same llama.cpp commit?)", endpoint.c_str()));
            return -1;
        }
        for (size_t i = 0; i < ggml_backend_reg_dev_count(server); ++i) {
            out.push_back(ggml_backend_reg_dev_get(server, i));
        }
        start = end + 1;
    }
    // then this machine's GPUs (integrated ones only where there is no other), as llama.cpp orders
    // the devices it finds without a list
    std::vector<ggml_backend_dev_t> gpus, igpus;
    for (size_t i = 0; i < ggml_backend_dev_count(); ++i) {
        ggml_backend_dev_t dev = ggml_backend_dev_get(i);
        if (is_rpc_dev(dev)) {
            continue;
        }
        switch (ggml_backend_dev_type(dev)) {
            case GGML_BACKEND_DEVICE_TYPE_GPU:  gpus.push_back(dev);  break;
            case GGML_BACKEND_DEVICE_TYPE_IGPU: igpus.push_back(dev); break;
            default: break;
        }
    }
    out.insert(out.end(), gpus.begin(), gpus.end());
    if (gpus.empty()) {
        out.insert(out.end(), igpus.begin(), igpus.end());
    }
    for (size_t i = 0; i < out.size() && (int32_t) i < n_max; ++i) {
        devs[i] = out[i];
    }
    if ((int32_t) out.size() < n_max) {
        devs[out.size()] = nullptr;
    }
    return (int32_t) out.size();
}

const char * llama_ridgefill_lost_rpc_servers(const struct llama_model * model) {
    static thread_local std::string lost;
    lost = model ? llama_ridgefill_lost_servers(*model) : "";
    return lost.c_str();
}

const char * llama_ridgefill_layer_device(const struct llama_model * model, int32_t il) {
    static thread_local std::string name;
    if (model == nullptr || il < 0 || il >= (int32_t) model->hparams.n_layer()) {
        return nullptr;
    }
    ggml_backend_dev_t dev = model->dev_layer(il);
    name = format("%s (%s)", ggml_backend_dev_name(dev), ggml_backend_dev_description(dev));
    return name.c_str();
}
