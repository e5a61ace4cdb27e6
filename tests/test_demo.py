"""The demo's serving path on the tiny target: vLLM's OpenAI server in a subprocess, a real HTTP request."""

import re
import socket

from peagle_ray.config import build_config
from peagle_ray.demo import run_demo


def test_demo_serves_a_chat_completion_and_stops_the_server(tiny_target, tmp_path, capsys):
    cfg = build_config({"target": {"path": str(tiny_target), "max_model_len": 512, "kv_cache_gib": 1},
                        "serving": {"log_dir": str(tmp_path)}})  # fmt: skip
    answer = run_demo(cfg, question="Say something.", max_tokens=8)
    out = capsys.readouterr().out
    assert answer and f"[demo] {tiny_target.name}: {answer}" in out
    assert "8 tokens" in out
    port = int(re.search(r"at http://127\.0\.0\.1:(\d+)/v1", out).group(1))
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0, "server still listening after the demo"
