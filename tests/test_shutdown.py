"""SIGTERM / SIGHUP stop `peagle-ray serve` like Ctrl-C: the endpoint, Ray and every process it started go,
the ports are freed, and the exit status says it was interrupted (128 + the signal)."""

import signal
import socket
import subprocess
import sys
import time

import psutil
import pytest

from peagle_ray.serve.app import free_port


def listening_ports(processes: list[psutil.Process]) -> set[int]:
    ports = set()
    for process in processes:
        try:
            ports |= {c.laddr.port for c in process.net_connections("inet") if c.status == psutil.CONN_LISTEN}
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return ports


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_a_stop_signal_to_serve_leaves_no_process_and_no_port(tiny_target, tmp_path, signum):
    port = free_port()
    command = [sys.executable, "-m", "peagle_ray.cli", "serve", "--no-drafter", "--set", f"target.path={tiny_target}",
               "--set", "target.max_model_len=256", "--set", "target.kv_cache_gib=1", "--set", f"serving.port={port}",
               "--set", f"serving.log_dir={tmp_path / 'logs'}"]  # fmt: skip
    log = (tmp_path / "serve.log").open("w+")
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 300
    while "endpoint: http" not in (tmp_path / "serve.log").read_text():
        assert server.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
        assert time.monotonic() < deadline, "the endpoint did not come up in 300 s"
        time.sleep(1)
    parent = psutil.Process(server.pid)
    children = parent.children(recursive=True)
    ports = listening_ports([parent, *children])
    assert len(children) >= 3 and port in ports  # Ray's GCS, raylet, agents, the Serve replica ...

    server.send_signal(signum)
    assert server.wait(timeout=120) == 128 + signum
    gone, alive = psutil.wait_procs(children, timeout=30)
    assert not alive, [(p.pid, p.name()) for p in alive]
    assert all(port_is_free(p) for p in ports), sorted(p for p in ports if not port_is_free(p))
    output = (tmp_path / "serve.log").read_text()
    assert f"interrupted ({signal.Signals(signum).name})" in output and "Traceback" not in output
