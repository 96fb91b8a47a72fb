// The fingerprint of a model GGUF file that map files record (ridgefill.model.fingerprint), so that
// the map loader itself refuses maps fitted on another checkpoint, whichever program loads them.
//
// The definition is ridgefill_cpp/maps/fingerprint.py's, byte for byte (the tests compare the two):
// SHA-256 over the architecture, the tensor layout (names, shapes in the file's own dimension
// count, types, sizes) and a sample of the tensor bytes: 64 blocks of 4 KiB evenly spaced over the
// tensor data, plus the first and last 4 KiB of every tensor of the embeddings, the output head and
// the first and last layer; "sha256:" and the first 32 hex digits. About a megabyte is read.
//
// The header is read here rather than with gguf_init_from_file(): gguf drops the file's dimension
// count (a [64, 1] tensor reads as [64]), and that count is part of the fingerprint.

#include "llama-ridgefill.h"
#include "llama-ridgefill-error.h"
#include "llama-ridgefill-fingerprint.h"

#include "llama-impl.h"
#include "llama-mmap.h"

#include "ggml.h"
#include "gguf.h"
#include "hash/hash.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

// bounded reads of a GGUF header; every failure names the file
struct rf_gguf_reader {
    llama_file & f;
    std::string  path;
    uint64_t     size;
    uint64_t     pos = 0;

    void read(void * dst, uint64_t n) {
        if (n > size - std::min(pos, size)) {
            throw std::runtime_error(format("%s: truncated or corrupt GGUF file (header ends early)", path.c_str()));
        }
        f.read_raw(dst, n);
        pos += n;
    }

    template <typename T> T scalar() {
        T v;
        read(&v, sizeof(v));
        return v;
    }

    std::string string() {
        const uint64_t n = scalar<uint64_t>();
        if (n > size) {
            throw std::runtime_error(format("%s: truncated or corrupt GGUF file (string longer than the file)", path.c_str()));
        }
        std::string s(n, '\0');
        read(s.data(), n);
        return s;
    }

    void skip(uint64_t n) {
        if (n > size - std::min(pos, size)) {
            throw std::runtime_error(format("%s: truncated or corrupt GGUF file (header ends early)", path.c_str()));
        }
        pos += n;
        f.seek(pos, SEEK_SET);
    }
};

// byte size of a scalar GGUF value type, 0 for strings and arrays
size_t rf_gguf_scalar_size(uint32_t type) {
    switch (type) {
        case GGUF_TYPE_UINT8:  case GGUF_TYPE_INT8:  case GGUF_TYPE_BOOL: return 1;
        case GGUF_TYPE_UINT16: case GGUF_TYPE_INT16:                      return 2;
        case GGUF_TYPE_UINT32: case GGUF_TYPE_INT32: case GGUF_TYPE_FLOAT32: return 4;
        case GGUF_TYPE_UINT64: case GGUF_TYPE_INT64: case GGUF_TYPE_FLOAT64: return 8;
        default: return 0;
    }
}

struct rf_tensor_info {
    std::string           name;
    std::vector<uint64_t> shape;
    uint32_t              type;
    uint64_t              offset;  // absolute, in the file
    uint64_t              n_bytes;
};

} // namespace

// one sequential read of a GGUF header (~140 lines) on purpose: it mirrors the format's layout field by
// field, in the order the bytes come in
std::string llama_ridgefill_model_fingerprint_file(const char * path) {
    llama_ridgefill_check_regular_file(path, "model");
    llama_file file(path, "rb");
    rf_gguf_reader r = { file, path, (uint64_t) file.size() };

    char magic[4];
    r.read(magic, 4);
    if (memcmp(magic, "GGUF", 4) != 0) {
        throw std::runtime_error(format("%s: not a GGUF file", path));
    }
    const uint32_t version = r.scalar<uint32_t>();
    if (version != 2 && version != 3) {
        throw std::runtime_error(format("%s: unsupported GGUF version %u", path, version));
    }
    const uint64_t n_tensors = r.scalar<uint64_t>();
    const uint64_t n_kv      = r.scalar<uint64_t>();
    if (n_tensors > r.size || n_kv > r.size) {
        throw std::runtime_error(format("%s: truncated or corrupt GGUF file (implausible tensor or key count)", path));
    }

    // the keys the fingerprint needs: strings and integer scalars; everything else is skipped
    std::map<std::string, std::string> strs;
    std::map<std::string, int64_t>     ints;
    for (uint64_t i = 0; i < n_kv; ++i) {
        const std::string key  = r.string();
        const uint32_t    type = r.scalar<uint32_t>();
        if (type == GGUF_TYPE_STRING) {
            strs[key] = r.string();
        } else if (type == GGUF_TYPE_ARRAY) {
            const uint32_t itype = r.scalar<uint32_t>();
            const uint64_t n     = r.scalar<uint64_t>();
            if (n > r.size) {
                throw std::runtime_error(format("%s: truncated or corrupt GGUF file (array longer than the file)", path));
            }
            if (itype == GGUF_TYPE_STRING) {
                for (uint64_t j = 0; j < n; ++j) {
                    r.skip(r.scalar<uint64_t>());
                }
            } else if (rf_gguf_scalar_size(itype) > 0) {
                r.skip(n * rf_gguf_scalar_size(itype));
            } else {
                throw std::runtime_error(format("%s: unsupported GGUF array of type %u (key %s)", path, itype, key.c_str()));
            }
        } else if (const size_t n = rf_gguf_scalar_size(type); n > 0) {
            uint64_t v = 0;
            r.read(&v, n);
            if (type == GGUF_TYPE_INT8)  { v = (uint64_t) (int64_t) (int8_t)  v; }
            if (type == GGUF_TYPE_INT16) { v = (uint64_t) (int64_t) (int16_t) v; }
            if (type == GGUF_TYPE_INT32) { v = (uint64_t) (int64_t) (int32_t) v; }
            if (type != GGUF_TYPE_FLOAT32 && type != GGUF_TYPE_FLOAT64) {
                ints[key] = (int64_t) v;
            }
        } else {
            throw std::runtime_error(format("%s: unknown GGUF value type %u (key %s)", path, type, key.c_str()));
        }
    }

    std::vector<rf_tensor_info> tensors(n_tensors);
    for (auto & t : tensors) {
        t.name = r.string();
        const uint32_t n_dims = r.scalar<uint32_t>();
        if (n_dims > 8) {
            throw std::runtime_error(format("%s: tensor %s has %u dimensions", path, t.name.c_str(), n_dims));
        }
        t.shape.resize(n_dims);
        for (auto & d : t.shape) {
            d = r.scalar<uint64_t>();
        }
        t.type   = r.scalar<uint32_t>();
        t.offset = r.scalar<uint64_t>();
    }
    const uint64_t align      = ints.count("general.alignment") ? (uint64_t) ints["general.alignment"] : 32;
    if (align == 0) {
        throw std::runtime_error(format("%s: general.alignment is 0", path));
    }
    const uint64_t data_start = (r.pos + align - 1) / align * align;
    for (auto & t : tensors) {
        if (t.type >= GGML_TYPE_COUNT || ggml_blck_size((ggml_type) t.type) == 0) {
            throw std::runtime_error(format("%s: tensor %s has unknown ggml type %u", path, t.name.c_str(), t.type));
        }
        uint64_t n = 1;
        for (uint64_t d : t.shape) {
            n *= d;
        }
        t.n_bytes = n / ggml_blck_size((ggml_type) t.type) * ggml_type_size((ggml_type) t.type);
        t.offset += data_start;
        if (t.offset + t.n_bytes > r.size) {
            throw std::runtime_error(format("%s: truncated GGUF file (tensor %s ends at byte %llu, file has %llu)", path,
                    t.name.c_str(), (unsigned long long) (t.offset + t.n_bytes), (unsigned long long) r.size));
        }
    }

    const std::string arch = strs.count("general.architecture") ? strs["general.architecture"] : "";
    std::string data = arch + '\0';
    for (const auto & t : tensors) {
        std::string shape = "[";
        for (size_t i = 0; i < t.shape.size(); ++i) {
            shape += (i ? ", " : "") + std::to_string(t.shape[i]);
        }
        data += t.name + ":" + shape + "]:" + std::to_string(t.type) + ":" + std::to_string(t.n_bytes) + ";";
    }

    if (!tensors.empty()) {
        const uint64_t block = 4096;
        auto sample = [&](uint64_t a, uint64_t b) {  // bytes [a, b) of the file, cut at its end
            b = std::min(b, r.size);
            if (a >= b) {
                return;
            }
            const size_t n0 = data.size();
            data.resize(n0 + (b - a));
            file.seek(a, SEEK_SET);
            file.read_raw(&data[n0], b - a);
        };
        const std::string key_blocks = arch + ".block_count";
        const int64_t last = (ints.count(key_blocks) ? ints[key_blocks] : 1) - 1;
        const std::string sampled[] = { "token_embd.", "output.", "blk.0.", "blk." + std::to_string(last) + "." };

        uint64_t start = UINT64_MAX;
        uint64_t end   = 0;
        for (const auto & t : tensors) {
            start = std::min(start, t.offset);
            end   = std::max(end, t.offset + t.n_bytes);
        }
        const uint64_t span = end - start > block ? end - start - block : 0;
        const int      n_spread = 64;
        for (int i = 0; i < n_spread; ++i) {
            const uint64_t off = start + span * i / (n_spread - 1);
            sample(off, off + block);
        }
        for (const auto & t : tensors) {
            if (std::none_of(std::begin(sampled), std::end(sampled), [&](const std::string & p) { return t.name.rfind(p, 0) == 0; })) {
                continue;
            }
            const uint64_t a = t.offset;
            const uint64_t b = t.offset + t.n_bytes;
            sample(a, std::min(a + block, b));
            sample(b > a + block ? b - block : a, b);
        }
    }
    return "sha256:" + hash_sha256_hex(data.data(), data.size()).substr(0, 32);
}

int32_t llama_ridgefill_model_fingerprint(const char * model_path, char * buf, size_t buf_size) {
    if (model_path == nullptr) {
        llama_ridgefill_set_error(__func__, "a model path is required");
        return -1;
    }
    std::string fp;
    try {
        fp = llama_ridgefill_model_fingerprint_file(model_path);
    } catch (const std::exception & e) {
        llama_ridgefill_set_error(__func__, e.what());
        return -1;
    }
    llama_ridgefill_clear_error();
    if (buf != nullptr && buf_size > 0) {
        snprintf(buf, buf_size, "%s", fp.c_str());
    }
    return (int32_t) fp.size();
}
