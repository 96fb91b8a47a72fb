#!/usr/bin/env bash
# The command of a GPU device lease (an H200, 15 minutes of device time): run from the repository
# root on the device, with gpu-pack/ carried (tools/gpu_pack.sh made it on the CPU machine):
#
#   bash tools/gpu_device.sh [tools/measure/gpu_h200.py options, e.g. --shapes 8b-dense-32 --repeats 3]
#
# It installs the carried wheels into /tmp/site, unpacks the CUDA libraries into /tmp/rf-lib, points
# ridgefill_cpp at them (RIDGEFILL_CPP_LIB_DIR) and at the device's own cuBLAS and CUDA runtime (the
# nvidia-* Python packages), records the GPU, and runs tools/measure/gpu_h200.py with everything written to
# $OUT (gpu-run.json, gpu-run.md, the log); then, with time left, tools/measure/gpu_h200_check.py's agreement
# with the oracle (check/gpu-check.json).
set -euo pipefail
out=${OUT:-/tmp/gpu-out}
mkdir -p "$out"
start=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site gpu-pack/wheels/*.whl
rm -rf /tmp/rf-lib && mkdir -p /tmp/rf-lib
tar -xJf gpu-pack/libs.tar.xz -C /tmp/rf-lib --strip-components=1
nvlibs=$(python3 - <<'PY'
import glob, os
dirs = set()
try:
    import nvidia
    for d in nvidia.__path__:
        for name in ("libcublas.so*", "libcublasLt.so*", "libcudart.so*"):
            dirs.update(os.path.dirname(p) for p in glob.glob(os.path.join(d, "**", name), recursive=True))
except ImportError:
    pass
print(":".join(sorted(dirs)))
PY
)
export LD_LIBRARY_PATH="/tmp/rf-lib:${nvlibs}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export RIDGEFILL_CPP_LIB_DIR=/tmp/rf-lib PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/nvidia-smi.csv" || true
echo "gpu-device: set up in $(( $(date +%s) - start )) s; libraries: $(ls /tmp/rf-lib | tr '\n' ' ')"
python3 tools/measure/gpu_h200.py --out "$out" "$@" 2>&1 | tee "$out/gpu-run.log" || true
# then, in a process of its own (an abort there loses nothing of the above) and only with time left, the
# agreement with the float64 oracle on the device: tiny models of every architecture, and the window-sized
# sliding-window cache (GPU_CHECK=0 skips it)
elapsed=$(( $(date +%s) - start ))
if [ "${GPU_CHECK:-1}" != 0 ] && [ "$elapsed" -lt 420 ]; then
    timeout $(( 500 - elapsed )) python3 tools/measure/gpu_h200_check.py --skip-speed --out "$out/check" 2>&1 \
        | tee "$out/gpu-check.log" || echo "gpu-device: the agreement check stopped (status $?)"
fi
echo "gpu-device: done in $(( $(date +%s) - start )) s"
