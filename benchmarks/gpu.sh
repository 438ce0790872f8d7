#!/usr/bin/env bash
# GPU benchmarks for a lent H200 (one call, < 8 minutes). Assumes torch, transformers, diffusers, trl, peft and
# accelerate are already installed in the active python; installs only this package (editable, no deps).
# Results: $OUT/gpu_results.json and $OUT/gpu_results.md (./gpu_results.* when $OUT is unset); back here, a real-size
# run goes into benchmarks/results/ with: python -m benchmarks.record $OUT/gpu_results.json --kind gpu_h200
#   bash benchmarks/gpu.sh                 # everything, real sizes, time guard 420 s
#   bash benchmarks/gpu.sh --only P4,P5    # a subset
#   bash benchmarks/gpu.sh --only P11      # image RL steps at SD3.5-M size: flow_grpo, awm, nft (~3 min)
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
if [ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ]; then PY=.venv/bin/python; fi
# the benchmarks run as a package from the repository root (python -m benchmarks.gpu), so unialign and benchmarks
# import from this checkout even if the editable install fails
"$PY" -m pip install -e . --no-deps -q 2>&1 | tail -2 || echo "pip install -e . failed; continuing from the checkout"
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TQDM_DISABLE=1
OUTDIR="${OUT:-.}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || true
timeout 470 "$PY" -m benchmarks.gpu --device cuda --time-budget 400 --output-dir "$OUTDIR" "$@"
rc=$?
[ $rc -eq 124 ] && echo "gpu.py hit the 470 s timeout; partial results are in $OUTDIR/gpu_results.*"
cat "$OUTDIR/gpu_results.md" 2>/dev/null
exit $rc
