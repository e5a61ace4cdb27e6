"""The package sources pip is configured with (`pip config list`: index-url, extra-index-url, find-links,
constraint), for the setup scripts that fetch packages without pip.

    python scripts/pip_settings.py PIP indexes    # one index URL a line, the main index first
    python scripts/pip_settings.py PIP uv-args    # the same sources as `uv pip install` flags, one a line

The most specific setting of index-url wins, as in pip (environment, then download/install, then global);
the list settings add up.
"""

from __future__ import annotations

import subprocess
import sys

RANK = {":env:": 0, "download": 1, "install": 2, "global": 3}
PYPI = "https://pypi.org/simple"


def pip_settings(pip: str) -> dict[str, list[tuple[str, str]]]:
    """option -> [(section, value)] from `pip config list`."""
    out = subprocess.run([pip, "config", "list"], capture_output=True, text=True, check=True).stdout
    settings: dict[str, list[tuple[str, str]]] = {}
    for line in out.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            section, _, option = key.rpartition(".")
            settings.setdefault(option, []).append((section, value.strip().strip("'\"")))
    return settings


def values(settings: dict[str, list[tuple[str, str]]], option: str) -> list[str]:
    """Every value of a list setting (each may hold several, space-separated), without repeats."""
    found = [v for _, value in settings.get(option, []) for v in value.split()]
    return list(dict.fromkeys(found))


def main_index(settings: dict[str, list[tuple[str, str]]]) -> str:
    return min(settings.get("index-url", []), key=lambda s: RANK.get(s[0], 9), default=(None, PYPI))[1]


def indexes(settings: dict[str, list[tuple[str, str]]]) -> list[str]:
    return [main_index(settings), *values(settings, "extra-index-url")]


def uv_args(settings: dict[str, list[tuple[str, str]]]) -> list[str]:
    """`uv pip install` flags for pip's sources. uv by default takes a package from the first index that has
    it; pip takes the best version across all of them, and so does uv with unsafe-best-match."""
    args = ["--index-url", main_index(settings), "--index-strategy", "unsafe-best-match"]
    for option, flag in (("extra-index-url", "--extra-index-url"), ("find-links", "--find-links"),
                         ("constraint", "--constraint")):  # fmt: skip
        for value in values(settings, option):
            args += [flag, value]
    return args


if __name__ == "__main__":
    pip, what = sys.argv[1:]
    settings = pip_settings(pip)
    print("\n".join(indexes(settings) if what == "indexes" else uv_args(settings)))
