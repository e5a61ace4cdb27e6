"""vLLM's own OpenAI-compatible server run as a subprocess, for the demo's first answer.

    with VllmOpenAIServer(target_dir, cfg) as server:
        print(server.chat([{"role": "user", "content": "Hi"}], max_tokens=64))

The server binds to cfg.serving.host (loopback by default); the context manager waits for /health, and
stops the process (and its engine core) on exit, including on Ctrl-C.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from peagle_ray.config import PeagleConfig
from peagle_ray.engine import vllm_cpu_env


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class VllmOpenAIServer:
    """A `python -m vllm.entrypoints.openai.api_server` process serving one model directory."""

    def __init__(self, model_dir: Path, cfg: PeagleConfig, port: int | None = None, startup_timeout_s: float = 600):
        self.model_dir = Path(model_dir)
        self.host = cfg.serving.host
        self.port = port or free_port(self.host)
        self.served_name = self.model_dir.name
        self.startup_timeout_s = startup_timeout_s
        self.log_path = Path(cfg.serving.log_dir) / f"vllm-server-{self.port}.log"
        self.command = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model_dir),
            "--served-model-name", self.served_name,
            "--host", self.host,
            "--port", str(self.port),
            "--dtype", cfg.target.dtype,
            "--max-model-len", str(cfg.target.max_model_len),
            "--enforce-eager",
        ]  # fmt: skip
        if cfg.target.trust_remote_code:
            self.command.append("--trust-remote-code")
        self.env = vllm_cpu_env(cfg.target.kv_cache_gib)
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __enter__(self) -> VllmOpenAIServer:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("w")
        # A new session so that stop() can signal the server and the engine-core process it spawns.
        self.process = subprocess.Popen(self.command, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                        start_new_session=True)  # fmt: skip
        self._wait_healthy()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"vLLM server exited with code {self.process.returncode}; log: {self.log_path}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(1)
        self.stop()
        raise TimeoutError(f"vLLM server not healthy after {self.startup_timeout_s:.0f}s; log: {self.log_path}")

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def chat(self, messages: list[dict], max_tokens: int, temperature: float = 0.0) -> dict:
        """POST /v1/chat/completions and return the parsed JSON response."""
        body = {"model": self.served_name, "messages": messages, "max_tokens": max_tokens,
                "temperature": temperature}  # fmt: skip
        request = urllib.request.Request(
            f"{self.url}/v1/chat/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=600) as resp:
            return json.loads(resp.read())
