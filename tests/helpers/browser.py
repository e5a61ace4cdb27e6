"""Headless Chromium (Debian's `chromium`, installed by scripts/setup.sh) rendering a page as a user sees it."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request

from websockets.sync.client import connect


def chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    assert path, "headless Chromium is missing: run `make setup` (apt-get install chromium)"
    return path


def render_until(url: str, *needles: str, timeout_s: float = 180) -> str:
    """The page's DOM once every needle is in it, polled once a second in real time through the DevTools
    protocol (Chromium's --virtual-time-budget runs ahead of a loaded machine: the MLflow UI's charts came too
    late even for 160 s of it); the last DOM if they do not all appear within `timeout_s`."""
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as profile:
        browser = subprocess.Popen(
            [
                chromium(),
                "--headless=new",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--remote-debugging-port=0",
                f"--user-data-dir={profile}",
                "--window-size=1400,1000",
                "about:blank",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,  # its renderer and GPU processes go with it
        )
        try:
            port = _devtools_port(browser)
            request = urllib.request.Request(
                f"http://127.0.0.1:{port}/json/new?{urllib.parse.quote(url)}", method="PUT"
            )
            with urllib.request.urlopen(request, timeout=30) as response:
                page = json.load(response)["webSocketDebuggerUrl"]
            with connect(page, max_size=None, open_timeout=30) as devtools:
                dom, deadline = "", time.monotonic() + timeout_s
                while time.monotonic() < deadline:
                    dom = _evaluate(devtools, "document.documentElement.outerHTML")
                    if all(needle in dom for needle in needles):
                        break
                    time.sleep(1)
                return dom
        finally:
            os.killpg(browser.pid, 9)
            browser.wait()


def _devtools_port(browser: subprocess.Popen) -> int:
    """The port Chromium chose, from the `DevTools listening on ws://127.0.0.1:PORT/...` line it prints."""
    for line in browser.stderr:
        found = re.search(r"DevTools listening on ws://[^:]+:(\d+)/", line)
        if found:
            return int(found.group(1))
    raise AssertionError(f"Chromium exited ({browser.wait()}) without opening its DevTools port")


def _evaluate(devtools, expression: str) -> str:
    devtools.send(json.dumps({"id": 1, "method": "Runtime.evaluate", "params": {"expression": expression}}))
    while True:
        message = json.loads(devtools.recv(timeout=60))
        if message.get("id") == 1:
            return message["result"]["result"].get("value", "")
