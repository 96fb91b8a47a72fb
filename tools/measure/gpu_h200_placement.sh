#!/usr/bin/env bash
# TTFT and VRAM of RidgeFill with resident vs host-placed maps on a CUDA GPU (issue #8), Gemma 3 270M
# Q4_K_M at 8K and 16K tokens. Run from a clone on a machine with an NVIDIA GPU, its driver and the
# CUDA toolkit (nvcc, cuBLAS); about 15 minutes (the CUDA compile is most of it).
#
#   tools/measure/gpu_h200_placement.sh [OUT_DIR]      (default ./cuda-placement)
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
out=${1:-$repo/cuda-placement}
cd "$repo"
mkdir -p "$out"

# 1. the CUDA build of the project (the same patched libllama, GGML_CUDA=ON) and the models
CMAKE_ARGS="-DGGML_CUDA=ON" make native models
.venv/bin/python -c 'import json, ridgefill_cpp.core.native as N; b = N.build_info(); print(json.dumps(b)); assert "CUDA" in b["backends"], "not a CUDA build"'

# 2. maps for Gemma 3 270M (default split, 100K calibration tokens), fitted on the GPU
model=$(.venv/bin/python -c "from ridgefill_cpp import models; print(models.available('gemma3-270m'))")
maps="$out/gemma3-270m.ridgefill.gguf"
[ -f "$maps" ] || .venv/bin/ridgefill-gguf fit "$model" -o "$maps"

# 3. stock / resident / host, each in its own process: TTFT (median of 5) and the process's VRAM
.venv/bin/python tools/measure/gpu_h200_placement.py --model "$model" --maps "$maps" --lengths 8192,16384 \
    --repeats 5 --json "$out/placement.json" | tee "$out/placement.txt"
