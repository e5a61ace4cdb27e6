#!/usr/bin/env bash
# The CUDA path, checked once on a lent GPU machine (device tool): the `gpu` test tier and the training-step
# benchmark at long context. Needs torch (CUDA), transformers, pydantic, pyyaml, safetensors, pytest; wheels in
# gpu_wheels/ (if carried) are installed first for whatever is missing. Writes results under $OUT (or ./gpu-out).
#   bash scripts/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
if [ -d gpu_wheels ]; then
  $PY -m pip install --quiet --no-index --no-deps gpu_wheels/*.whl 2>&1 | tail -3
fi
$PY - <<'PY' | tee "$OUT/env.txt"
import torch, transformers
print(f"torch {torch.__version__}, cuda {torch.version.cuda}, device {torch.cuda.get_device_name(0)}, "
      f"transformers {transformers.__version__}")
PY
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
# The gpu tier (compiled flex vs SDPA, bf16 gradients, bf16 steps on a SmolLM2-shaped drafter).
timeout 420 $PY -m pytest -q -m gpu -p no:cacheprovider -o addopts="" tests/test_gpu.py 2>&1 | tee "$OUT/gpu_tests.txt"
# One partitioned training step at N = 8192, K = 8 (and N = 2048 for a ratio), tokens/s and peak GPU memory.
for n in 2048 8192; do
  timeout 240 $PY -m peagle_ray.bench.train_memory "$n" 8 1 16384 32768 1 1 2>&1 | tail -1 | tee "$OUT/train_step_n${n}_k8.json"
done
