"""The Ray cluster a job runs on: joining it, and whether a storage path is shared by all of its nodes.

Under `ray job submit` (RAY_ADDRESS set) every entry point joins the submitted-to cluster; otherwise it
starts a local one. Ray Train writes checkpoints from the workers' nodes and reads them back on whichever
node a worker restarts, so a local `training.storage_path` works only where every node sees the same files
(one host, or an NFS mount at the same path); `unshared_nodes` probes that with a file and a task per node.
"""

from __future__ import annotations

import logging
import os
import uuid
from pathlib import Path

from peagle_ray import stopping

# Settings of a cluster this process starts, read by Ray's own processes (inherited from this one's environment),
# unless already set. Serve's controller gives a new HTTP proxy 5 s to answer its first ready check and then
# kills it (RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S, Ray 2.60), which makes serve.start() fail with "The actor is
# dead because it was killed by `ray.kill`" where starting a worker process takes longer: seen on a 2-core box
# with both cores busy (a proxy worker importing Ray beside a vLLM engine). A cluster started with `ray start`
# takes the same variable from the environment of `ray start`.
LOCAL_CLUSTER_ENV = {"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60"}


def ensure_ray() -> None:
    """Join the cluster named by RAY_ADDRESS (e.g. under `ray job submit`) or start a local one."""
    import ray

    if not ray.is_initialized():
        if not joined_cluster():
            set_local_cluster_env()
        # the console keeps warnings; Ray's INFO lines are in /tmp/ray/session_latest/logs
        ray.init(address="auto" if joined_cluster() else None, log_to_driver=False, logging_level=logging.WARNING)
        stopping.reinstall()  # ray.init replaced SIGTERM's handler with sys.exit(15)
    quiet_serve_console()


def set_local_cluster_env() -> None:
    """LOCAL_CLUSTER_ENV into this process's environment, where not set already: call before ray.init starts a
    local cluster (its processes inherit it)."""
    for name, value in LOCAL_CLUSTER_ENV.items():
        os.environ.setdefault(name, value)


def ray_running() -> bool:
    """Whether this process is connected to a Ray cluster (without importing Ray)."""
    import sys

    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


def leave_cluster() -> None:
    """Shut down the Ray cluster this process started, its Serve replicas first, gracefully (a vLLM engine
    process outlives a killed replica). A joined cluster (RAY_ADDRESS, as under `ray job submit` or
    `serve --detach`) keeps its Serve apps and is only disconnected from."""
    import sys

    if ray_running():
        if "ray.serve" in sys.modules and not joined_cluster():
            sys.modules["ray.serve"].shutdown()
        sys.modules["ray"].shutdown()


def quiet_serve_console() -> None:
    """Serve's driver-side logger prints each deploy and delete ("Application ... is ready") at INFO to the
    console only (the controller's own log in /tmp/ray/session_latest/logs/serve has them); keep its warnings.
    Importing ray.serve sets that logger to INFO, so it is imported here first."""
    import ray.serve  # noqa: F401

    logging.getLogger("ray.serve").setLevel(logging.WARNING)


def joined_cluster() -> bool:
    """Whether ensure_ray joins a running cluster (RAY_ADDRESS set) rather than starting one that ray.shutdown()
    takes down with everything on it."""
    return bool(os.environ.get("RAY_ADDRESS"))


def alive_nodes() -> list[dict]:
    """The cluster's alive nodes (ray.nodes() entries). Ray must be initialised."""
    import ray

    return [n for n in ray.nodes() if n["Alive"]]


def _sees(path: str, token: str) -> bool:
    marker = Path(path)
    return marker.is_file() and marker.read_text() == token


def unshared_nodes(directory: Path) -> list[str]:
    """Alive nodes (as "node_id (ip)") that do not see a file the driver writes into `directory`: one task
    pinned to each node reads it back. Empty on a single node or a shared file system."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nodes = alive_nodes()
    if len(nodes) < 2:
        return []
    directory.mkdir(parents=True, exist_ok=True)
    token = uuid.uuid4().hex
    marker = directory / f".peagle-shared-{token}"
    marker.write_text(token)
    try:
        sees = ray.remote(num_cpus=0)(_sees)
        pinned = [
            sees.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote(
                str(marker), token
            )
            for n in nodes
        ]
        seen = ray.get(pinned, timeout=120)
    finally:
        marker.unlink(missing_ok=True)
    return [f"{n['NodeID'][:12]} ({n['NodeManagerAddress']})" for n, ok in zip(nodes, seen, strict=True) if not ok]


def ensure_serve_http(host: str, port: int, replace: bool = True) -> None:
    """Start Serve with its HTTP proxy on host:port (serving.host / serving.port). Serve keeps the HTTP options
    it first started with, so every stage starts it this way (the capture target too). With replace, a Serve
    instance running with other options is shut down (its applications with it) and started again, which
    kills its controller mid-task (Ray prints "killed by ray.kill" on the console); without, it is kept."""
    from ray import serve

    # No public API reads a running Serve instance's HTTP options in Ray 2.60: serve.status() has proxies and
    # applications but no host or port; serve.start() with other options only warns ("The new client HTTP
    # config differs from the existing one") and keeps the old ones; the REST API that lists them
    # (/api/serve/applications/) needs the dashboard, which clusters may run without. So the controller's
    # client is read here, in one place, and `serve.start` stays the only way Serve is started.
    from ray.serve.context import _get_global_client

    client = _get_global_client(raise_if_no_controller_running=False)
    if client is not None:
        current = client.http_config
        if (current.host, current.port) == (host, port) or not replace:
            return
        serve.shutdown()
    serve.start(http_options={"host": host, "port": port})
