"""The main job: `peagle-ray demo` / `make demo`, the whole pipeline on one machine.

    local Ray cluster + local MLflow server
    -> target (embedded SmolLM2, converted once)               `peagle-ray target prepare`
    -> data.sources (demo: built-in suite, regenerated)        `peagle-ray data prepare`
    -> offline capture only (capture.mode: offline)            `peagle-ray data capture`
    -> P-EAGLE trained on the capture in Ray Train             `peagle-ray train`
    -> the EAGLE-3 baseline on the same data and budget        `peagle-ray train --set drafter.algorithm=eagle3`
    -> evaluation sweep, recommended K into each drafter       `peagle-ray eval`
    -> the REST endpoint with the P-EAGLE drafter              `peagle-ray serve`

Every stage is the same code its own command runs. The budget is the config's (configs/demo.yaml fits
~40 minutes on 2 cores); `--scale N` multiplies the training steps. Ctrl-C stops the endpoint, Ray and
MLflow. Stages whose output already exists (target, prepared data, captured shards, finished training)
are reused, so rerunning an interrupted run resumes it (configs/cpu-full.yaml relies on it).
"""

from __future__ import annotations

import time
from pathlib import Path

from peagle_ray.config import PeagleConfig, with_values


def _stage(name: str, started: float) -> None:
    print(f"\n[demo] === {name} ({(time.monotonic() - started) / 60:.1f} min in) ===", flush=True)


def run_demo(cfg: PeagleConfig, scale: float = 1.0, wait: bool = True, on_ready=None) -> dict:
    """Run every stage; returns {"endpoint", "mlflow", "eval", "table"}. With wait, serve until Ctrl-C
    (or SIGTERM / SIGHUP through the CLI), which stops everything and raises KeyboardInterrupt; otherwise
    call on_ready(endpoint_url) (if given) and stop everything."""
    import ray
    from ray import serve

    from peagle_ray.cluster import ensure_ray
    from peagle_ray.eval.sweep import evaluate
    from peagle_ray.export.speculators import read_drafter
    from peagle_ray.serve.app import drafting_line, endpoint_banner, start_endpoint, stop_endpoint
    from peagle_ray.tracking import tracking_uri

    started = time.monotonic()
    cfg = _with_target(cfg, scale, started)
    ensure_ray()
    print(
        f"[demo] logs: {Path(cfg.serving.log_dir).resolve()} (vLLM engines), /tmp/ray/session_latest/logs (Ray; "
        "Ray Data's progress in ray-data/ray-data.log)",
        flush=True,
    )
    with tracking_uri(cfg, Path(cfg.training.storage_path) / "mlflow") as uri:
        cfg = with_values(cfg, {"tracking.tracking_uri": uri})
        print(f"[demo] MLflow UI: {uri}")
        try:
            drafters = _data_and_training(cfg, started)
            _stage(f"evaluate: target alone, EAGLE-3 and P-EAGLE at K = {cfg.eval.k_values}", started)
            evaluated = evaluate(cfg, drafters)
            _stage("serve the P-EAGLE drafter", started)
            target = Path(cfg.target.path)
            drafter = read_drafter(drafters["peagle"])
            url = start_endpoint(cfg, target, drafter)
            print(
                f"\n{evaluated['table']}\n\nresults: {evaluated['json']}\nMLflow UI: {uri}\n"
                f"{endpoint_banner(url, cfg).replace('MODEL', target.name)}\n"
                f"{drafting_line(drafter, cfg.serving.num_speculative_tokens)}\n"
                f"[demo] done in {(time.monotonic() - started) / 60:.1f} min",
                flush=True,
            )
            if on_ready is not None:
                on_ready(url)
            if wait:
                print("[demo] the endpoint is live; Ctrl-C stops it (and Ray and MLflow)", flush=True)
                while True:
                    time.sleep(3600)
            return {"endpoint": url, "mlflow": uri, "eval": evaluated["results"], "table": evaluated["table"]}
        except KeyboardInterrupt:
            print("\n[demo] stopping: the endpoint, Ray and MLflow", flush=True)
            raise  # after the cleanup below; the CLI exits 128 + the signal
        finally:
            try:
                stop_endpoint()
                serve.shutdown()
            finally:
                ray.shutdown()


def _with_target(cfg: PeagleConfig, scale: float, started: float) -> PeagleConfig:
    """The config with the target prepared (the embedded one converted once), the steps scaled, storage absolute."""
    from peagle_ray.target import prepare_embedded_target

    _stage("target", started)
    target = Path(cfg.target.path) if cfg.target.path else prepare_embedded_target(cfg.cache_path())
    steps = max(1, round(cfg.training.max_steps * scale))
    storage = Path(cfg.training.storage_path).resolve()
    print(f"[demo] target {target}; training budget {steps} steps per algorithm")
    return with_values(
        cfg, {"target.path": str(target), "training.max_steps": steps, "training.storage_path": str(storage)}
    )


def _data_and_training(cfg: PeagleConfig, started: float) -> dict[str, Path]:
    """Prepared data (reused when present), offline capture (resumed), then P-EAGLE and EAGLE-3 trained on the
    same data and budget; {algorithm: export directory}."""
    from peagle_ray.capture.run import prepare_and_capture, samples_to_capture
    from peagle_ray.data.prepare import read_summary
    from peagle_ray.eval.sweep import run_name_for
    from peagle_ray.train.job import run_training

    regenerated = ", responses regenerated by the target" if cfg.data.regenerate else ""
    _stage(f"data: {', '.join(cfg.data.sources)}{regenerated}", started)
    prepare = read_summary(cfg.data.output_dir) is None
    if not prepare:
        print(f"[demo] reusing prepared data in {cfg.data.output_dir}")
    # offline capture writes hidden states once (resumed where a previous run stopped)
    capture = cfg.capture.mode == "offline" and (prepare or bool(samples_to_capture(cfg)[0]))
    if prepare or capture:
        prepare_and_capture(cfg, prepare=prepare, capture=capture)
    drafters = {}
    for algorithm in ("peagle", "eagle3"):
        _stage(f"train {algorithm} ({cfg.capture.mode} capture -> Ray Train)", started)
        run_cfg = with_values(cfg, {"drafter.algorithm": algorithm, "training.run_name": run_name_for(cfg, algorithm)})
        drafters[algorithm] = Path(run_training(run_cfg)["export_dir"])
    return drafters
