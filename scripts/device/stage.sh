#!/usr/bin/env bash
# First device call (carry: [".device/a"]): keep the first half of the TVM wheel on the machine for the second
# call, and record what the machine has. Run scripts/device/run_gpu.sh right after (the machine stays warm ~30 s).
set -euo pipefail
mkdir -p /tmp/tvmdm-device
cp .device/a/tvm.whl.part0 /tmp/tvmdm-device/
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python3 -c 'import sys, torch, onnxruntime; print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.cuda.is_available(), "onnxruntime", onnxruntime.__version__, onnxruntime.get_available_providers())'
echo "staged $(du -h /tmp/tvmdm-device/tvm.whl.part0 | cut -f1) of the TVM wheel"
