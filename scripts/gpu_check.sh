#!/usr/bin/env bash
# The CUDA path, checked in one run of <= 10 minutes on a lent GPU machine that has only torch and
# transformers (device tool: run scripts/gpu_wheels.sh here first and carry gpu_wheels/):
#   1. what is missing of pydantic and pytest, installed from gpu_wheels/ (no index)
#   2. the `gpu` test tier: compiled flex attention against SDPA (loss, gradients), bfloat16 gradients and steps
#   3. the step table (peagle_ray/bench/step_table.py): one training step at the Qwen3-8B and Llama-3.1-8B
#      drafter shapes (H 4096, full vocabularies, draft vocabulary 32k, K = 8, bfloat16) at N = 2048, 8192,
#      32768: ours with compiled flex and with SDPA, the reference trainer's where speculators is installed;
#      tokens/s, peak GPU memory and our dry run's estimate
# Results under $OUT (or ./gpu-out): env.txt, gpu_tests.txt, step_table.json (+ .md, .log).
#   bash scripts/gpu_check.sh
# The CPU rehearsal (tests/test_gpu_check.py) runs the same script on the tiny shape:
#   GPU_CHECK_SHAPES=tiny GPU_CHECK_SEQ_LENS="64 256" GPU_CHECK_SEGMENT=128 bash scripts/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
SHAPES=${GPU_CHECK_SHAPES:-qwen3-8b llama3.1-8b}
SEQ_LENS=${GPU_CHECK_SEQ_LENS:-2048 8192 32768}
SEGMENT=${GPU_CHECK_SEGMENT:-8192}
if [ -d gpu_wheels ]; then
  $PY -m pip install --quiet --disable-pip-version-check --no-index --find-links gpu_wheels pydantic pytest 2>&1 | tail -3
fi
$PY - <<'PY' | tee "$OUT/env.txt"
import torch, transformers
device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu (rehearsal)"
print(f"torch {torch.__version__}, cuda {torch.version.cuda}, device {device}, transformers {transformers.__version__}")
PY
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
status=0
timeout 200 $PY -m pytest -q -m gpu -p no:cacheprovider -o addopts="" tests/test_gpu.py 2>&1 | tee "$OUT/gpu_tests.txt"
[ "${PIPESTATUS[0]}" = 0 ] || status=1
# each (shape, trainer, attention) in a process of its own, 100 s at most: an out-of-memory or a slow compile
# costs a row, not the table
timeout 400 $PY -m peagle_ray.cli bench step-table --shapes $SHAPES --seq-lens $SEQ_LENS --segment-length "$SEGMENT" \
  --timeout-s 100 --json "$OUT/step_table.json" > "$OUT/step_table.log" 2>&1
[ $? = 0 ] || { status=1; tail -20 "$OUT/step_table.log"; }
$PY -c "import json, sys; print(json.load(open(sys.argv[1]))['table'])" "$OUT/step_table.json" | tee "$OUT/step_table.md"
exit $status
