#!/usr/bin/env bash
# Second device call (carry: [".device/b"]): join the TVM wheel, install the wheels, run the GPU session.
#   bash scripts/device/run_gpu.sh [gpu_run options...]      e.g. --budget 480
# Writes into $OUT (the device tool's folder; ./gpu-out elsewhere): gpu_run.json, gpu_run.png, gpu_run.log and
# tuning_logs/ (copy it to tuning_logs/bert-base-layer-cuda to ship it).
set -euo pipefail
out=${OUT:-gpu-out}
part0=/tmp/tvmdm-device/tvm.whl.part0
[ -f "$part0" ] || part0=.device/a/tvm.whl.part0   # both halves carried (a machine kept warm, or run locally)
[ -f "$part0" ] || { echo "first half of the TVM wheel missing: run scripts/device/stage.sh first" >&2; exit 2; }
mkdir -p /tmp/tvmdm-wheels
wheel=/tmp/tvmdm-wheels/$(cat .device/b/tvm.whl.name)
cat "$part0" .device/b/tvm.whl.part1 > "$wheel"
cp .device/b/*.whl /tmp/tvmdm-wheels/
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    /tmp/tvmdm-wheels/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
python3 -m tvmdm.bench.gpu_run "$out" "$@"
