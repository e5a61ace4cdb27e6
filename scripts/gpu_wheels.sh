#!/usr/bin/env bash
# The wheels scripts/gpu_check.sh needs on a GPU machine that has only torch and transformers, written to
# gpu_wheels/ (git-ignored): pass it to the device tool's `carry`. pydantic's compiled core is fetched for
# CPython 3.10-3.13 (the machine's Python is not known beforehand); the versions are this venv's.
#   bash scripts/gpu_wheels.sh
# Left out: the reference trainer (speculators 0.9). Importing it imports `datasets`, which needs pyarrow
# (55 MB for one Python version) and pandas (12 MB): 72 MB with the rest, over the device tool's 64 MiB
# carry. gpu_check.sh runs its rows where speculators is already installed, and says so where not.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
out=gpu_wheels
rm -rf "$out"
mkdir -p "$out"
pinned() { for p in "$@"; do echo "$p==$("$PY" -c "from importlib.metadata import version; print(version('$p'))")"; done; }
download() { "$PY" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary :all: -d "$out" "$@" 2>&1 \
  | grep -v "is ignored: it is neither a file nor a directory" || true; }
download $(pinned pydantic annotated-types typing-inspection typing_extensions pytest pluggy iniconfig pygments)
core=$(pinned pydantic_core)
for v in 3.10 3.11 3.12 3.13; do
  download --python-version "$v" --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 "$core"
done
ls "$out"
du -sh "$out"
