#!/usr/bin/env bash
# Prepare a GPU device run on this (CPU) machine: the CUDA libraries for sm_90 and the pure-Python
# wheels the device lacks, packed into gpu-pack/ (git-ignored), which the device tool carries.
#
#   make gpu-pack            (or tools/gpu_pack.sh [BUILD_DIR], default /tmp/ridgefill-cuda-build)
#
# Then, with a device lent, one call of the device tool runs the whole measurement (about 8 minutes):
#   run(command="bash tools/gpu_device.sh", carry=["gpu-pack"], timeout_s=540)
# (docs/gpu-h200/README.md: "Preparing a lease"). The libraries come from tools/check_cuda_build.sh
# (one architecture, sm_90; cuBLAS is the device's own, the build links it from PyPI's nvidia-cublas
# of the same major version). The device has nvcc, cmake, ninja, numpy, torch, typer, rich, xxhash and
# nvidia-cublas but no package registry: gguf, llama-cpp-python's Python layer and diskcache travel as
# wheels. What travels with the working tree (tracked and untracked files, and gpu-pack/) must stay under
# 64 MiB: the libraries are packed with xz and the script says how much room is left.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-/tmp/ridgefill-cuda-build}
py=${PYTHON:-$repo/.venv/bin/python}
pack=$repo/gpu-pack
limit=$((64 * 1024 * 1024))

"$repo/tools/check_cuda_build.sh" "$build"

rm -rf "$pack.tmp" && mkdir -p "$pack.tmp/lib" "$pack.tmp/wheels"
# what the Python package loads: libllama and the ggml libraries (the CUDA backend among them)
for lib in libllama.so libggml.so libggml-base.so libggml-cpu.so libggml-cuda.so libggml-rpc.so; do
    found=$(find "$build/cmake" -name "$lib" -not -path "*/CMakeFiles/*" | head -n 1)
    if [ -z "$found" ]; then
        echo "gpu-pack: $lib not found under $build/cmake" >&2
        exit 1
    fi
    cp -L "$found" "$pack.tmp/lib/"
done
strip --strip-unneeded "$pack.tmp"/lib/*.so
tar -C "$pack.tmp" -cJf "$pack.tmp/libs.tar.xz" lib
rm -rf "$pack.tmp/lib"

# pure-Python wheels for the device's Python (3.12): gguf and its requests-free needs, the Python layer
# of llama-cpp-python built by `make setup`, diskcache (llama-cpp-python imports it)
cp "${RIDGEFILL_CACHE:-$HOME/.cache/ridgefill-cpp}"/wheels/llama-cpp-python-*-pylayer/llama_cpp_python-*.whl "$pack.tmp/wheels/"
gguf_version=$("$py" -c "import importlib.metadata as m; print(m.version('gguf'))")
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform any \
    -d "$pack.tmp/wheels" "gguf==$gguf_version" diskcache

rm -rf "$pack" && mv "$pack.tmp" "$pack"
pack_bytes=$(du -sb "$pack" | cut -f1)
tree_bytes=$(cd "$repo" && { git ls-files -z; git ls-files -z --others --exclude-standard; } | xargs -0 du -cb 2>/dev/null | tail -n 1 | cut -f1)
total=$((pack_bytes + tree_bytes))
echo "gpu-pack: $pack: $((pack_bytes / 1024 / 1024)) MiB (libraries xz-packed, wheels), working tree $((tree_bytes / 1024 / 1024)) MiB:" \
     "$((total / 1024 / 1024)) of the 64 MiB a device call carries"
if [ "$total" -gt "$limit" ]; then
    echo "gpu-pack: too large for one device call: build on the device instead (tools/gpu_device.sh --build)" >&2
    exit 1
fi
