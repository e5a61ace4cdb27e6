#!/usr/bin/env bash
# The CUDA path, checked in one run of <= 10 minutes on a lent GPU machine (device tool: run
# scripts/gpu_wheels.sh here first and carry gpu_wheels/):
#   1. what the image lacks (pydantic, the reference trainer speculators and its import chain), installed from
#      gpu_wheels/ (no index)
#   2. the `gpu` test tier: compiled flex attention against SDPA (loss, gradients), bfloat16 gradients and steps
#   3. the host-sync proxy at the Qwen3-8B drafter shape (bench host-syncs: device reads and input copies per
#      step, counted on the meta device), beside the profiler's own measure in the table
#   4. the step table (peagle_ray/bench/step_table.py): one training step at the Qwen3-8B drafter shape (H 4096,
#      its full vocabulary, draft vocabulary 32k, K = 8, bfloat16) at N = 2048, 8192, 32768: ours with compiled
#      flex and with SDPA, and the reference trainer's; median and spread of 5 steps after warm-up, tokens/s,
#      peak GPU memory, the GPU's busy share of a profiled step, and our dry run's estimate
# Results under $OUT (or ./gpu-out): env.txt, gpu_tests.txt, host_syncs.json, step_table.json (+ .md, .log).
#   bash scripts/gpu_check.sh
# The CPU rehearsal (tests/test_gpu_check.py) runs the same script on the tiny shape:
#   GPU_CHECK_SHAPES=tiny GPU_CHECK_SEQ_LENS="64 256" GPU_CHECK_SEGMENT=128 bash scripts/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
SHAPES=${GPU_CHECK_SHAPES:-qwen3-8b}
SEQ_LENS=${GPU_CHECK_SEQ_LENS:-2048 8192 32768}
SEGMENT=${GPU_CHECK_SEGMENT:-8192}
if [ -d gpu_wheels ]; then
  $PY -m pip install --quiet --disable-pip-version-check --no-index --find-links gpu_wheels pydantic pytest 2>&1 | tail -3
  # the reference without its pins' resolution: the image's torch, transformers, pyarrow and pandas stay
  $PY -m pip install --quiet --disable-pip-version-check --no-index --find-links gpu_wheels --no-deps speculators \
    hs-connectors pydantic-settings python-dotenv loguru datasets dill multiprocess openai sniffio jiter httpx2 \
    httpcore2 truststore 2>&1 | tail -3
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
timeout 60 $PY -m peagle_ray.cli bench host-syncs --shape "${SHAPES%% *}" --seq-len 8192 --segment-length 2048 \
  --json "$OUT/host_syncs.json" > "$OUT/host_syncs.log" 2>&1 || { status=1; tail -5 "$OUT/host_syncs.log"; }
grep "^{'algorithm'" "$OUT/host_syncs.log"
# each (shape, trainer, attention) in a process of its own, 130 s at most: an out-of-memory or a slow compile
# costs a row, not the table
timeout 420 $PY -m peagle_ray.cli bench step-table --shapes $SHAPES --seq-lens $SEQ_LENS --segment-length "$SEGMENT" \
  --timeout-s 130 --json "$OUT/step_table.json" > "$OUT/step_table.log" 2>&1
[ $? = 0 ] || { status=1; tail -20 "$OUT/step_table.log"; }
$PY -c "import json, sys; print(json.load(open(sys.argv[1]))['table'])" "$OUT/step_table.json" | tee "$OUT/step_table.md"
exit $status
