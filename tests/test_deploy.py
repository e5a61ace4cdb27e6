"""deploy/ and docker/: the manifests parse and point at real entry points, files and config keys."""

import importlib
import re
import shlex
import tomllib

import pytest
import yaml

from peagle_ray.config import load_config
from peagle_ray.serve.app import APP_NAME
from tests.conftest import REPO
from tests.test_multinode import TRAIN_CMD


def check_serve_application(app: dict) -> None:
    """import_path resolves to a callable; its config file exists and loads with its overrides."""
    module, _, attr = app["import_path"].partition(":")
    assert callable(getattr(importlib.import_module(module), attr)), app["import_path"]
    assert app["name"] == APP_NAME and app["route_prefix"] == "/"
    args = app["args"]
    assert (REPO / args["config"]).is_file(), args["config"]
    load_config(REPO / args["config"], args.get("set", []))  # raises ConfigError on an unknown key or bad value


def check_job_entrypoint(entrypoint: str) -> None:
    """`python jobs/X.py --config FILE [--set k=v ...]`: the job exists and the config loads."""
    words = shlex.split(entrypoint)
    assert words[0] == "python" and (REPO / words[1]).is_file(), entrypoint
    config = words[words.index("--config") + 1]
    overrides = [words[i + 1] for i, w in enumerate(words) if w == "--set"]
    load_config(REPO / config, overrides)


def check_serve_config(config: dict) -> None:
    """Ray Serve's own schema accepts the file (what `serve deploy` and KubeRay validate it against)."""
    from ray.serve.schema import ServeDeploySchema

    ServeDeploySchema.model_validate(config)


def test_serve_yaml():
    config = yaml.safe_load((REPO / "deploy/serve.yaml").read_text())
    check_serve_config(config)
    assert config["http_options"]["host"] == "127.0.0.1"
    for app in config["applications"]:
        check_serve_application(app)


def test_kuberay_rayjob_trains_through_the_job_entry_point():
    job = yaml.safe_load((REPO / "deploy/kuberay/rayjob-train.yaml").read_text())
    assert job["apiVersion"] == "ray.io/v1" and job["kind"] == "RayJob"
    check_job_entrypoint(job["spec"]["entrypoint"])
    assert tuple(shlex.split(job["spec"]["entrypoint"])[:3]) == TRAIN_CMD  # what the two-node test submits
    assert job["spec"]["rayClusterSpec"]["rayVersion"] == "2.60.0"
    assert "RAY_AUTH_MODE" in yaml.safe_load(job["spec"]["runtimeEnvYAML"])["env_vars"]


def test_every_node_of_the_rayjob_mounts_the_paths_its_config_names():
    """Workers on any node read the target, prepared data and shards and write checkpoints: each absolute
    path of the job's config lies under a volume every Ray container mounts."""
    job = yaml.safe_load((REPO / "deploy/kuberay/rayjob-train.yaml").read_text())
    words = shlex.split(job["spec"]["entrypoint"])
    cfg = load_config(REPO / words[words.index("--config") + 1])
    paths = [cfg.target.path, cfg.data.output_dir, cfg.capture.output_dir, cfg.training.storage_path]
    spec = job["spec"]["rayClusterSpec"]
    pods = [spec["headGroupSpec"]["template"], *(g["template"] for g in spec["workerGroupSpecs"])]
    for pod in pods:
        for container in pod["spec"]["containers"]:
            mounts = [m["mountPath"] for m in container["volumeMounts"]]
            for path in paths:
                assert any(path.startswith(m.rstrip("/") + "/") for m in mounts), (container["name"], path)


def test_kuberay_rayservice_serves_the_builder():
    service = yaml.safe_load((REPO / "deploy/kuberay/rayservice-serve.yaml").read_text())
    assert service["kind"] == "RayService"
    serve_config = yaml.safe_load(service["spec"]["serveConfigV2"])
    check_serve_config(serve_config)  # it refused the runtime_env working_dir /app this file had
    for app in serve_config["applications"]:
        check_serve_application(app)
    assert service["spec"]["rayClusterConfig"]["rayVersion"] == "2.60.0"


@pytest.mark.parametrize("name,extra", [("Dockerfile", "gpu"), ("Dockerfile.cpu", "cpu")])
def test_dockerfiles_install_a_real_extra_and_run_a_real_command(name, extra):
    text = (REPO / "docker" / name).read_text()
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extra in extras
    assert f".[{extra}]" in text or "scripts/setup.sh" in text
    for copied in re.findall(r"^COPY (\S+)", text, flags=re.M):
        assert (REPO / copied).exists(), copied
    cmd = yaml.safe_load(re.search(r"^CMD (.+)$", text, flags=re.M).group(1))
    assert cmd[0] == "peagle-ray" and (REPO / cmd[cmd.index("--config") + 1]).is_file()
    from peagle_ray.cli import build_parser

    build_parser().parse_args(cmd[1:])  # a real subcommand with real options
