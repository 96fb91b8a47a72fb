#!/usr/bin/env bash
# Check that the patched tree (with csrc/) compiles with the CUDA backend, on a machine that has nvcc
# but no GPU and no cuBLAS (like the project's CPU machines). Not part of CI: 18 minutes on 2 cores.
#
#   tools/check_cuda_build.sh [BUILD_DIR]      (default /tmp/ridgefill-cuda-build)
#
# cuBLAS comes from PyPI (nvidia-cublas, CUDA 13) and is merged with the local toolkit into a
# scratch toolkit directory; GGML_CUDA_NO_VMM=ON avoids linking the driver library (libcuda.so),
# which only a machine with a GPU driver has. One architecture (sm_90) keeps the compile short.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-/tmp/ridgefill-cuda-build}
cuda=${CUDA_HOME:-/usr/local/cuda}
py=${PYTHON:-$repo/.venv/bin/python}
scratch=$build/toolkit
mkdir -p "$build"
if [ ! -d "$build/cublas/nvidia" ]; then
    "$py" -m pip install -q --no-deps --target "$build/cublas" "nvidia-cublas>=13,<14"
fi
rm -rf "$scratch" && mkdir -p "$scratch/include" "$scratch/lib64"
cp -rs "$cuda/include/." "$scratch/include/"
cp -rs "$build"/cublas/nvidia/cu13/include/. "$scratch/include/"
cp -rs "$cuda/lib64/." "$scratch/lib64/"
ln -sf "$build"/cublas/nvidia/cu13/lib/libcublas.so.13   "$scratch/lib64/libcublas.so"
ln -sf "$build"/cublas/nvidia/cu13/lib/libcublasLt.so.13 "$scratch/lib64/libcublasLt.so"
ln -sfn "$cuda/bin" "$scratch/bin"
ln -sfn "$cuda/nvvm" "$scratch/nvvm"
start=$(date +%s)
cmake -S "$repo" -B "$build/cmake" -G Ninja -DGGML_CUDA=ON -DGGML_CUDA_NO_VMM=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
      -DCUDAToolkit_ROOT="$scratch" -DCMAKE_CUDA_COMPILER="$cuda/bin/nvcc" -DPython_EXECUTABLE="$py" \
      -DRIDGEFILL_LLAMA_SOURCE_DIR="$build/llama.cpp" \
      -DCMAKE_EXE_LINKER_FLAGS="-Wl,-rpath-link,$build/cublas/nvidia/cu13/lib"
cmake --build "$build/cmake" --target llama llama-server
echo "CUDA build OK in $(( $(date +%s) - start )) s: $build/cmake"
