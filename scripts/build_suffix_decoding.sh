#!/usr/bin/env bash
# vLLM's suffix decoding (`speculative_config: {method: suffix}`) needs arctic-inference's suffix tree. The
# package index has only its source for this platform, and installing it also registers a vLLM plugin written
# for another vLLM release. This builds just the suffix-tree extension from that source (nanobind + cmake,
# about a minute) into the virtualenv's site-packages as `arctic_inference.suffix_decoding`, with no plugin
# entry point. `make setup` (scripts/setup.sh) runs it; a second run finds the build and returns at once.
#     scripts/build_suffix_decoding.sh [DEST]     # DEST: default the venv's site-packages
# The source comes from the package indexes pip is configured with (scripts/pip_settings.py reads `pip config
# list`: index-url, default PyPI, and extra-index-url), checked against the index's sha256 where it gives one.
set -euo pipefail
VERSION=0.3.0
PY="${VENV:-.venv}/bin/python"
DEST="${1:-$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')}"
MARKER="$DEST/arctic_inference/suffix_decoding/.peagle-ray-build"

if [ "$(cat "$MARKER" 2>/dev/null)" = "$VERSION" ] \
  && PYTHONPATH="$DEST" "$PY" -c "from arctic_inference.suffix_decoding import SuffixDecodingCache" 2>/dev/null; then
  echo "suffix decoding: arctic-inference $VERSION's suffix tree is already built in $DEST"
  exit 0
fi
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

# the source archive itself (pip download would first install its build requirements, torch among them)
"$PY" - "$VERSION" "$WORK" "$("$PY" "$(dirname "$0")/pip_settings.py" "$(dirname "$PY")/pip" indexes)" <<'PYTHON'
import hashlib, re, sys, urllib.parse, urllib.request
from pathlib import Path

version, work, listed = sys.argv[1:]
name = f"arctic_inference-{version}.tar.gz"
indexes = listed.split()


def read(url: str) -> bytes:
    parsed = urllib.parse.urlparse(url)
    if parsed.scheme == "file":  # a local index: a directory holds its index.html
        path = Path(urllib.parse.unquote(parsed.path))
        return (path / "index.html" if path.is_dir() else path).read_bytes()
    return urllib.request.urlopen(url, timeout=300).read()


for index in indexes:
    page = index.rstrip("/") + "/arctic-inference/"
    try:
        links = re.findall(r'href="([^"]+)"', read(page).decode())
    except (OSError, ValueError):
        continue  # not on this index
    found = [urllib.parse.urljoin(page, u) for u in links if urllib.parse.urlparse(u).path.endswith(name)]
    if found:
        url, _, fragment = found[0].partition("#")
        data = read(url)
        digest = fragment.removeprefix("sha256=") if fragment.startswith("sha256=") else None
        assert digest in (None, hashlib.sha256(data).hexdigest()), f"{name}: sha256 differs from {index}'s"
        Path(work, name).write_bytes(data)
        print(f"suffix decoding: {name} from {index}")
        break
else:
    sys.exit(f"suffix decoding: {name} is on none of pip's indexes ({', '.join(indexes)})")
PYTHON
tar -xzf "$WORK"/arctic_inference-$VERSION.tar.gz -C "$WORK"
SRC="$WORK/arctic_inference-$VERSION"
TOOLS=("nanobind==2.9.2")
command -v cmake >/dev/null || TOOLS+=("cmake")  # from the package index when the machine has none
command -v ninja >/dev/null || TOOLS+=("ninja")
"$PY" -m pip install --quiet --disable-pip-version-check --target "$WORK/tools" "${TOOLS[@]}" 2>&1 \
  | grep -v "is ignored: it is neither a file nor a directory" || true
export PATH="$WORK/tools/bin:$PATH" PYTHONPATH="$WORK/tools"
cmake -S "$SRC/csrc/suffix_decoding" -B "$WORK/build" -G Ninja \
    -DCMAKE_BUILD_TYPE=Release -DPython_EXECUTABLE="$(readlink -f "$PY")" >"$WORK/cmake.log" 2>&1 \
  || { tail -30 "$WORK/cmake.log" >&2; exit 1; }
cmake --build "$WORK/build" >>"$WORK/cmake.log" 2>&1 || { tail -30 "$WORK/cmake.log" >&2; exit 1; }
unset PYTHONPATH

rm -rf "$DEST/arctic_inference"
mkdir -p "$DEST/arctic_inference/suffix_decoding"
cp "$SRC/LICENSE" "$DEST/arctic_inference/"
touch "$DEST/arctic_inference/__init__.py"
cp "$SRC"/arctic_inference/suffix_decoding/*.py "$DEST/arctic_inference/suffix_decoding/"
cp "$WORK"/build/_C*.so "$DEST/arctic_inference/suffix_decoding/"
PYTHONPATH="$DEST" "$PY" -c "from arctic_inference.suffix_decoding import SuffixDecodingCache"
echo "$VERSION" >"$MARKER"
echo "suffix decoding: built arctic-inference $VERSION's suffix tree (Apache-2.0) into $DEST"
