"""Headless Chromium (Debian's `chromium`, installed by scripts/setup.sh) rendering a page as a user sees it."""

from __future__ import annotations

import shutil
import subprocess


def chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    assert path, "headless Chromium is missing: run `make setup` (apt-get install chromium)"
    return path


def render_dom(url: str, wait_ms: int = 20000) -> str:
    """The page's DOM after its scripts ran for `wait_ms` of virtual time (the MLflow UI is a React app)."""
    result = subprocess.run(
        [
            chromium(),
            "--headless=new",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            f"--virtual-time-budget={wait_ms}",
            "--window-size=1400,1000",
            "--dump-dom",
            url,
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


def render_until(url: str, *needles: str, budgets_ms: tuple[int, ...] = (20000, 40000, 80000, 160000)) -> str:
    """The page's DOM once every needle is in it, rendering again with more virtual time while one is missing
    (a loaded machine draws the MLflow UI's charts later); the last DOM if they never all appear."""
    dom = ""
    for budget in budgets_ms:
        dom = render_dom(url, budget)
        if all(needle in dom for needle in needles):
            break
    return dom
