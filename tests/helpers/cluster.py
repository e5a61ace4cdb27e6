"""A multi-node Ray cluster on loopback for the distributed tests: `ray start --head` plus worker nodes
(`ray start --address=...`), each a raylet of its own with distinct node IDs, token auth on, driven only
through Ray's CLI (`ray job submit`, `ray list actors`) as a user would. The pytest process never joins it
(it may hold its own local cluster from the `ray_local` fixture), and `ray stop` is never called, since it
would stop every Ray process on the machine: nodes are killed by the PIDs they started.
"""

from __future__ import annotations

import json
import os
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from peagle_ray.cluster import LOCAL_CLUSTER_ENV
from peagle_ray.serve.app import free_port

BIN = Path(sys.executable).parent


@dataclass
class Node:
    name: str
    args: list[str]
    hidden: Path | None = None
    node_id: str = ""

    @property
    def temp_dir(self) -> str:
        return next(a.split("=", 1)[1] for a in self.args if a.startswith("--temp-dir="))


def _processes(pids: set[int]) -> list[psutil.Process]:
    alive = []
    for pid in pids:
        try:
            alive.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    return alive


class LoopbackCluster:
    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.gcs_port, self.dashboard_port = free_port(), free_port()
        self.address = f"127.0.0.1:{self.gcs_port}"
        self.dashboard = f"http://127.0.0.1:{self.dashboard_port}"
        self.env = {
            **os.environ,
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN": secrets.token_hex(16),
            "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",  # the job's `python` is this venv's
            "RAY_USAGE_STATS_ENABLED": "0",
            # A dead raylet is noticed in ~3 s instead of ~16 s (the GCS's health checks).
            "RAY_health_check_period_ms": "1000",
            "RAY_health_check_timeout_ms": "1000",
            "RAY_health_check_failure_threshold": "3",
            **LOCAL_CLUSTER_ENV,  # Serve's HTTP proxy is given time to start on a busy box
        }
        self.nodes: dict[str, Node] = {}
        self.temp_dirs: list[str] = []  # of every node started, removed ones included

    # ---- nodes ------------------------------------------------------------------------------------------

    @staticmethod
    def _pids_mentioning(*needles: str) -> set[int]:
        """Processes with any of `needles` in an argument of their command line."""
        pids = set()
        for p in psutil.process_iter(["pid", "cmdline"]):
            if any(n in arg for arg in p.info["cmdline"] or () for n in needles):
                pids.add(p.info["pid"])
        return pids

    def _cluster_pids(self) -> set[int]:
        """Every process of this cluster: each names its node's temp dir (sockets, logs, session) or the
        GCS address (the GCS server itself as --gcs_server_port=N)."""
        return self._pids_mentioning(*self.temp_dirs, f":{self.gcs_port}", f"={self.gcs_port}")

    def _start(self, node: Node) -> Node:
        command = [str(BIN / "ray"), "start", *node.args]
        if node.hidden:  # a private mount namespace in which an empty tmpfs covers the directory
            mount = f"mount -t tmpfs tmpfs {shlex.quote(str(node.hidden))} && exec {shlex.join(command)}"
            command = ["unshare", "--mount", "--propagation", "private", "sh", "-c", mount]
        result = subprocess.run(command, env=self.env, capture_output=True, text=True, timeout=120, cwd=self.tmp)
        if result.returncode != 0:
            raise AssertionError(f"ray start exited {result.returncode}:\n{result.stdout}\n{result.stderr}")
        raylet = self.raylet(node)
        node.node_id = next(a.split("=", 1)[1] for a in raylet.cmdline() if a.startswith("--node_id="))
        self.nodes[node.name] = node
        return node

    def node_processes(self, node: Node) -> list[psutil.Process]:
        """The node's processes now (raylet, agents, log monitor, workers): all name its temp dir."""
        return _processes(self._pids_mentioning(node.temp_dir))

    def raylet(self, node: Node) -> psutil.Process:
        return next(p for p in self.node_processes(node) if Path(p.cmdline()[0]).name == "raylet")

    def _temp_dir(self, name: str) -> str:
        """Each node its own Ray temp dir, as on separate machines: nodes sharing one would share
        runtime_resources, and one node's cleanup of a job's working_dir would pull it from under another's.
        Short, under /tmp: Ray's socket paths live there."""
        temp = tempfile.mkdtemp(prefix=f"ray-{name}-", dir="/tmp")
        self.temp_dirs.append(temp)
        return temp

    def start_head(self, num_cpus: int = 1) -> Node:
        """`ray start --head` records its address as this machine's default cluster (/tmp/ray/
        ray_current_cluster), which a later `ray.init()` in the test process would join (and fail on, token
        auth, or once this cluster is gone); the file is put back as it was."""
        from ray._common.utils import get_ray_address_file

        address_file = Path(get_ray_address_file(None))
        previous = address_file.read_text() if address_file.is_file() else None
        try:
            return self._start_head(num_cpus)
        finally:
            if previous is None:
                address_file.unlink(missing_ok=True)
            else:
                address_file.write_text(previous)

    def _start_head(self, num_cpus: int) -> Node:
        args = [
            "--head",
            f"--temp-dir={self._temp_dir('head')}",
            "--node-ip-address=127.0.0.1",
            f"--port={self.gcs_port}",
            f"--num-cpus={num_cpus}",
            "--dashboard-host=127.0.0.1",
            f"--dashboard-port={self.dashboard_port}",
            f"--ray-client-server-port={free_port()}",
            f"--dashboard-agent-listen-port={free_port()}",
            "--object-store-memory=200000000",
            '--resources={"head": 1}',
            "--disable-usage-stats",
        ]
        return self._start(Node("head", args))

    def add_node(self, name: str, num_cpus: int = 1, hidden: Path | None = None) -> Node:
        """A worker node with a custom resource named after it (tests can pin work to it). With `hidden`, the
        node does not see that directory's files, as a machine without the driver's disk would not."""
        args = [
            f"--address={self.address}",
            f"--temp-dir={self._temp_dir(name)}",
            "--node-ip-address=127.0.0.1",
            f"--num-cpus={num_cpus}",
            f"--dashboard-agent-listen-port={free_port()}",
            "--object-store-memory=200000000",
            f"--resources={json.dumps({name: 1})}",
            "--disable-usage-stats",
        ]
        return self._start(Node(name, args, hidden=hidden))

    def kill_node(self, name: str) -> float:
        """SIGKILL the node's raylet (its workers and agents go with it), then its leftovers; returns the
        time it was killed."""
        node = self.nodes[name]
        self.raylet(node).send_signal(signal.SIGKILL)
        killed = time.time()
        leftovers = self.node_processes(node)
        for p in leftovers:
            p.kill()
        psutil.wait_procs(leftovers, timeout=30)
        return killed

    def remove_node(self, name: str) -> None:
        self.kill_node(name)
        self.nodes.pop(name)

    def restart_node(self, name: str) -> Node:
        return self._start(self.nodes.pop(name))  # same arguments and temp dir; _start reads the new node id

    def wait_alive(self, count: int, timeout: float = 60) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if len(self.alive_nodes()) == count:
                return
            time.sleep(0.5)
        raise TimeoutError(f"the cluster did not reach {count} alive nodes: {self.alive_nodes()}")

    def stop(self) -> None:
        procs = _processes(self._cluster_pids())
        for p in procs:
            p.kill()
        psutil.wait_procs(procs, timeout=30)
        for temp in self.temp_dirs:
            shutil.rmtree(temp, ignore_errors=True)

    # ---- Ray's CLI --------------------------------------------------------------------------------------

    def run(self, *args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
        exe = str(BIN / args[0])
        result = subprocess.run(
            [exe, *args[1:]], env=self.env, capture_output=True, text=True, timeout=timeout, cwd=self.tmp
        )
        if check and result.returncode != 0:
            raise AssertionError(f"{' '.join(args)} exited {result.returncode}:\n{result.stdout}\n{result.stderr}")
        return result

    def _submit_args(self, working_dir: Path, entrypoint: tuple[str, ...], env_vars: dict | None) -> list[str]:
        runtime_env = [f"--runtime-env-json={json.dumps({'env_vars': env_vars})}"] if env_vars else []
        address, directory = f"--address={self.dashboard}", f"--working-dir={working_dir}"
        return ["ray", "job", "submit", address, directory, *runtime_env, "--", *entrypoint]

    def submit(self, working_dir: Path, *entrypoint: str, check: bool = True) -> subprocess.CompletedProcess:
        """`ray job submit` and wait for the job (its logs are the output)."""
        return self.run(*self._submit_args(working_dir, entrypoint, None), check=check)

    def submit_background(self, working_dir: Path, *entrypoint: str, env_vars: dict | None = None) -> subprocess.Popen:
        """`ray job submit` in the background (its output goes to job-*.log in the cluster's directory);
        env_vars go into the job's runtime_env, so every actor of the job sees them."""
        ray, *args = self._submit_args(working_dir, entrypoint, env_vars)
        log = open(self.tmp / f"job-{time.time_ns()}.log", "w")
        return subprocess.Popen(
            [str(BIN / ray), *args], env=self.env, stdout=log, stderr=subprocess.STDOUT, cwd=self.tmp
        )

    def alive_nodes(self) -> list[dict]:
        out = self.run("ray", "list", "nodes", f"--address={self.dashboard}", "--format=json", check=False)
        if out.returncode != 0:
            return []
        return [n for n in json.loads(out.stdout) if n["state"] == "ALIVE"]

    def actors(self) -> list[dict]:
        """Every actor the cluster has run (alive or dead) with its class name and node id."""
        out = self.run("ray", "list", "actors", f"--address={self.dashboard}", "--format=json", "--limit=10000")
        return json.loads(out.stdout)
