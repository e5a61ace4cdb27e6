#!/usr/bin/env bash
# The wheels scripts/gpu_check.sh needs on a lent GPU machine, written to gpu_wheels/ (git-ignored): pass it
# to the device tool's `carry`. The machine's image already holds torch, transformers, pytest, pyarrow, pandas,
# httpx, aiohttp, xxhash, ... (the device tool's KINDS.md lists them); what is fetched here is the rest of what
# our code and the reference trainer (speculators 0.9: its import chain pulls in datasets, openai, pydantic)
# import: ~7 MB. The compiled ones (pydantic_core, jiter) and multiprocess are fetched for CPython 3.10-3.13
# (the image's Python is 3.12 today; a later one may differ); the versions are this venv's.
#   bash scripts/gpu_wheels.sh
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
# the reference trainer: speculators and what of its import chain the image lacks
download $(pinned speculators hs-connectors pydantic-settings python-dotenv loguru datasets dill openai sniffio \
  httpx2 httpcore2 truststore)
compiled=$(pinned pydantic_core jiter multiprocess)
for v in 3.10 3.11 3.12 3.13; do
  download --python-version "$v" --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 $compiled
done
ls "$out"
du -sh "$out"
