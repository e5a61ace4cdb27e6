"""SIGTERM / SIGHUP stop `peagle-ray serve` like Ctrl-C: the endpoint, Ray and every process it started go,
the ports are freed, and the exit status says it was interrupted (128 + the signal)."""

import contextlib
import signal
import socket
import subprocess
import sys
import time

import psutil
import pytest

from peagle_ray.serve.app import free_port

pytestmark = pytest.mark.vllm


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


def process_tree(process: subprocess.Popen) -> list[psutil.Process]:
    """The command's process and every descendant it has now."""
    parent = psutil.Process(process.pid)
    return [parent, *parent.children(recursive=True)]


@contextlib.contextmanager
def started(command: list[str], log_path, ready: str, timeout_s: float = 300):
    """Start a CLI command and wait until its output shows `ready`; a test that fails before the command has
    ended kills it and everything it started (a Ray cluster and its engines would otherwise outlive the test
    and slow every test after it)."""
    log = log_path.open("w+")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + timeout_s
        while ready not in log_path.read_text():
            assert process.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, f"{ready!r} did not appear in {timeout_s:.0f} s"
            time.sleep(1)
        yield process
    finally:
        if process.poll() is None:
            leftovers = process_tree(process)
            for p in leftovers:
                with contextlib.suppress(psutil.NoSuchProcess):
                    p.kill()
            psutil.wait_procs(leftovers, timeout=30)


def wait_listening(process: subprocess.Popen, port: int, timeout_s: float = 60) -> None:
    """`port` is listened on by the process or one of its descendants within timeout_s (Serve's proxy may
    bind it a moment after the command prints its banner)."""
    deadline = time.monotonic() + timeout_s
    while port not in listening_ports(process_tree(process)):
        assert time.monotonic() < deadline, f"nothing listens on port {port} {timeout_s:.0f} s after the banner"
        time.sleep(1)


def stop_and_check(process: subprocess.Popen, signum: int, log_path) -> None:
    """Send `signum`; every descendant must end, every port they listened on be free, the exit say why."""
    tree = process_tree(process)
    children, ports = tree[1:], listening_ports(tree)
    assert len(children) >= 3 and ports  # Ray's GCS, raylet, agents, the Serve replica, MLflow ...
    process.send_signal(signum)
    assert process.wait(timeout=120) == 128 + signum, log_path.read_text()[-3000:]
    gone, alive = psutil.wait_procs(children, timeout=90)  # Ray's agents notice their raylet is gone (30 s was
    # not enough once with both cores busy: a RuntimeEnvAgent outlived it)
    assert not alive, [(p.pid, p.name()) for p in alive]
    assert all(port_is_free(p) for p in ports), sorted(p for p in ports if not port_is_free(p))
    output = log_path.read_text()
    assert f"interrupted ({signal.Signals(signum).name})" in output and "Traceback" not in output


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "peagle_ray.cli", *args]


def test_sighup_to_serve_leaves_no_process_and_no_port(tiny_target, tmp_path):
    """SIGHUP (the terminal closed) here, SIGTERM to the demo below: both stop signals end to end."""
    port = free_port()
    with started(
        cli(
            "serve",
            "--no-drafter",
            "--set",
            f"target.path={tiny_target}",
            "--set",
            "target.max_model_len=256",
            "--set",
            "target.kv_cache_gib=1",
            "--set",
            f"serving.port={port}",
            "--set",
            f"serving.log_dir={tmp_path / 'logs'}",
        ),
        tmp_path / "serve.log",
        "endpoint: http",
    ) as server:
        wait_listening(server, port)
        stop_and_check(server, signal.SIGHUP, tmp_path / "serve.log")


def test_sigterm_to_the_demo_mid_run_stops_mlflow_ray_and_the_target(tiny_target, tmp_path):
    mlflow_port = free_port()
    with started(
        cli(
            "demo",
            "--no-wait",
            "--set",
            f"target.path={tiny_target}",
            "--set",
            "target.max_model_len=256",
            "--set",
            "target.kv_cache_gib=1",
            "--set",
            f"tracking.port={mlflow_port}",
            "--set",
            f"serving.port={free_port()}",  # not 8000, which the other xdist worker's cluster may hold
            "--set",
            f"training.storage_path={tmp_path / 'runs'}",
            "--set",
            f"data.output_dir={tmp_path / 'data'}",
            "--set",
            "data.max_new_tokens=64",
        ),
        tmp_path / "demo.log",
        "prepare: ",  # regeneration's bar: it starts once the target is up (Serve's INFO lines stay off the console)
    ) as demo:
        assert not port_is_free(mlflow_port)  # the local MLflow server is up
        stop_and_check(demo, signal.SIGTERM, tmp_path / "demo.log")
    assert "[demo] stopping" in (tmp_path / "demo.log").read_text()
