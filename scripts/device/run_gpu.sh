#!/usr/bin/env bash
# The one device call of a lent-GPU session (carry: [".device/run"]), after `python -m tvmdm.bench.gpu_prepare`
# here. Unpacks TVM's runtime (no compiler travels: the GPU machine only loads and runs what was compiled here)
# and runs the plan under one budget:
#   bash scripts/device/run_gpu.sh [--budget 540] [--no-torch-compile]
# Writes gpu_run.json and gpu_run.log into $OUT (the device tool's folder; ./gpu-out elsewhere).
set -euo pipefail
run=${TVMDM_RUN_DIR:-.device/run}
out=${OUT:-gpu-out}
[ -f "$run/plan.json" ] || { echo "$run/plan.json missing: run python -m tvmdm.bench.gpu_prepare first" >&2; exit 2; }
site=$(mktemp -d /tmp/tvmdm-site.XXXX)
# (Python's tarfile: the GPU machine's image need not have xz)
python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter="data")' "$run/runtime.tar.xz" "$site"
site=$site/site
export PYTHONPATH=$site:$PWD TVM_USE_RUNTIME_LIB=1 PYTHONUNBUFFERED=1
exec python3 -m tvmdm.bench.gpu_run "$run" "$out" "$@"
