#!/usr/bin/env bash
# vLLM's suffix decoding (`speculative_config: {method: suffix}`) needs arctic-inference's suffix tree. PyPI has
# only its source for this platform, and installing it also registers a vLLM plugin written for another vLLM
# release. This builds just the suffix-tree extension from that source (nanobind + cmake, under a minute) into
# DIR (default ~/.cache/peagle-ray/suffix-decoding), with no plugin entry point; `bench adapt` measures suffix
# decoding when DIR is on PYTHONPATH:
#     scripts/build_suffix_decoding.sh && PYTHONPATH=~/.cache/peagle-ray/suffix-decoding peagle-ray bench adapt ...
set -euo pipefail
VERSION=0.3.0
PY="${VENV:-.venv}/bin/python"
DEST="${1:-$HOME/.cache/peagle-ray/suffix-decoding}"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

# the source archive itself (pip download would first install its build requirements, torch among them)
"$PY" - "$VERSION" "$WORK" <<'PYTHON'
import hashlib, re, sys, urllib.request
version, work = sys.argv[1:]
index = urllib.request.urlopen("https://pypi.org/simple/arctic-inference/", timeout=60).read().decode()
name = f"arctic_inference-{version}.tar.gz"
(url,) = [u for u in re.findall(r'href="([^"]+)"', index) if f"/{name}#sha256=" in u]
url, digest = url.split("#sha256=")
data = urllib.request.urlopen(url, timeout=300).read()
assert hashlib.sha256(data).hexdigest() == digest, f"{name}: sha256 differs from the index's"
open(f"{work}/{name}", "wb").write(data)
PYTHON
tar -xzf "$WORK"/arctic_inference-$VERSION.tar.gz -C "$WORK"
SRC="$WORK/arctic_inference-$VERSION"
"$PY" -m pip install --quiet --target "$WORK/tools" "nanobind==2.9.2"
PYTHONPATH="$WORK/tools" cmake -S "$SRC/csrc/suffix_decoding" -B "$WORK/build" -G Ninja \
    -DCMAKE_BUILD_TYPE=Release -DPython_EXECUTABLE="$(readlink -f "$PY")" >"$WORK/cmake.log"
cmake --build "$WORK/build" >>"$WORK/cmake.log"

rm -rf "$DEST/arctic_inference"
mkdir -p "$DEST/arctic_inference/suffix_decoding"
cp "$SRC/LICENSE" "$DEST/arctic_inference/"
touch "$DEST/arctic_inference/__init__.py"
cp "$SRC"/arctic_inference/suffix_decoding/*.py "$DEST/arctic_inference/suffix_decoding/"
cp "$WORK"/build/_C*.so "$DEST/arctic_inference/suffix_decoding/"
PYTHONPATH="$DEST" "$PY" -c "from arctic_inference.suffix_decoding import SuffixDecodingCache"
echo "suffix decoding built into $DEST (arctic-inference $VERSION, Apache-2.0); use PYTHONPATH=$DEST"
