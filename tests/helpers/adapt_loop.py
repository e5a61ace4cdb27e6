"""The adaptation loop run once per test session on the tiny target (conftest's `adapt_loop` fixture), for the
tests that each check one part of it (tests/test_adapt.py, tests/test_bench_adapt.py): a random drafter
registered and served with recording on, a narrow workload sent through the endpoint, `adapt` on a snapshot
of that recording while paced requests keep flowing, a drafter that cannot load swapped in (and refused), and
continuous mode's round with too little traffic. Real Ray Serve, vLLM, Ray Train, MLflow."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import openai
import torch

from peagle_ray.adapt import AdaptReport, adapt_cycle, run_adapt
from peagle_ray.config import ConfigError, PeagleConfig, build_config, with_values
from peagle_ray.drafter.build import drafter_for_target
from peagle_ray.export.speculators import export_drafter, read_drafter
from peagle_ray.serve.app import free_port, start_endpoint, stop_endpoint, swap_drafter
from peagle_ray.tracking import register_export

K = 3
WORKLOAD = [  # a narrow workload: every prompt comes back several times (a held-out request repeats one)
    "def parse_config(path):",
    "SELECT name FROM users WHERE",
    "import numpy as np\n",
    "class Stack:\n    def push(self, x):",
    "The capital of France is",
    "for i in range(10):",
    "git commit -m",
    "Dear customer, thank you for",
]
REPEATS = 3
TOKENS = 16


def adapt_cfg(tmp: Path, tiny_target: Path, **adapt) -> PeagleConfig:
    return build_config(
        {
            "target": {"path": str(tiny_target), "max_model_len": 256, "kv_cache_gib": 1},
            "drafter": {"num_depths": K, "draft_vocab_size": 400},
            "training": {
                "num_workers": 1,
                "learning_rate": 3e-3,
                "warmup_steps": 10,
                "sequences_per_step": 4,
                "segment_length": 64,
                "validate_every": 1000,
                "epochs": 1000,
                "storage_path": str(tmp / "train"),
                "run_name": "served",
            },
            # K asked for: served with the drafter even where its measured verdict is the target alone (the
            # tiny target decodes faster than any drafter saves), so that every swap loads a drafter
            "serving": {"port": free_port(), "record_dir": str(tmp / "traffic"), "num_speculative_tokens": K},
            "eval": {"prompts_per_category": 1, "timing_prompts": 1, "max_new_tokens": TOKENS},
            "tracking": {"tracking_uri": f"sqlite:///{tmp / 'mlflow.db'}"},
            "adapt": {"max_steps": 120, "min_requests": 8, **adapt},
        }
    )


def register_parent(cfg: PeagleConfig, tiny_target: Path, tmp: Path) -> Path:
    """A random (untrained) drafter registered as version 1, which takes the `serving` alias; its export."""
    drafter, _, _ = drafter_for_target(
        tiny_target, cfg.drafter, torch.arange(516.0), 3, torch.Generator().manual_seed(0)
    )
    export = export_drafter(drafter, tmp / "parent-export", tiny_target, [2, 3, 5], K)
    assert register_export(cfg.tracking.tracking_uri, cfg, "served", export, tmp / "mlflow") == "1"
    return export


class Traffic:
    """Requests sent one after another from a thread until stopped (or `count` sent), pause_s apart; each
    outcome kept. Each request's conversation id is `<tag>-<n>`, so adapt's split of a recording is the same
    in every run. Paced traffic leaves the 2 cores to training and judging: vLLM's engine busy-polls for 1 s after each step
    (shm_broadcast busy_loop_s), so a request every second would keep a core spinning."""

    def __init__(self, url, model, expected: dict[str, list[int]], tag: str, pause_s: float = 0.0, count=None):
        self.api = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
        self.model, self.expected, self.tag, self.pause_s, self.count = model, expected, tag, pause_s, count
        self.ok, self.failed, self.mismatched = 0, [], []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        i = 0
        while i != self.count and not self._stop.wait(self.pause_s):
            prompt = WORKLOAD[i % len(WORKLOAD)]
            metadata = {"conversation_id": f"{self.tag}-{i}"}
            i += 1
            try:
                out = self.api.completions.create(
                    model=self.model,
                    prompt=prompt,
                    max_tokens=TOKENS,
                    temperature=0,
                    extra_body={"ignore_eos": True, "return_token_ids": True, "metadata": metadata},
                )
            except Exception as err:  # noqa: BLE001 - every failure is the finding
                self.failed.append(repr(err)[:300])
                continue
            self.ok += 1
            if out.choices[0].token_ids != self.expected[prompt]:
                self.mismatched.append(prompt)

    def join(self) -> None:
        """Wait until `count` requests were sent."""
        self._thread.join()

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(180)


@dataclass
class AdaptLoop:
    """Everything the session's adaptation loop did, for the tests to check part by part."""

    cfg: PeagleConfig
    tmp: Path
    report: AdaptReport
    recorded: Traffic  # the workload, recorded
    during: Traffic  # paced requests while adapt ran and swapped
    failing: Traffic  # paced requests while a drafter that cannot load was swapped in
    stats: dict  # /v1/speculative_stats after the adaptation
    after_failure: dict  # ... after the failed swap
    skipped: AdaptReport | None  # continuous mode's round with too little traffic
    refusals: dict[str, str] = field(default_factory=dict)  # what adapt refused before and during, by case
    swap_error: str = ""
    switching: Traffic | None = None  # paced requests while the endpoint switched to the hybrid decoder
    hybrid_stats: dict = field(default_factory=dict)  # /v1/speculative_stats on the hybrid


def recorded_lines(directory: Path) -> int:
    return sum(1 for f in directory.glob("*.jsonl") for _ in f.open())


def run_loop(tiny_target: Path, tmp: Path, expected: dict[str, list[int]]) -> AdaptLoop:
    general = tmp / "general.jsonl"  # adapt.replay: general data mixed in, never judged as traffic
    chats = [
        [{"role": "user", "content": f"Tell me about {i}."}, {"role": "assistant", "content": f"{i} is {i}."}]
        for i in range(6)
    ]
    general.write_text("".join(json.dumps({"messages": m}) + "\n" for m in chats))
    snapshot = tmp / "traffic-snapshot"  # adapt reads what the workload left, not what later requests add
    cfg = adapt_cfg(tmp, tiny_target, replay=[str(general)], traffic_dir=str(snapshot))
    refusals = {}
    snapshot.mkdir()
    (snapshot / "traffic-0.jsonl").write_text('{"schema": "peagle-traffic/1"}\n')
    try:
        run_adapt(cfg)
    except ConfigError as err:
        refusals["no alias"] = str(err)
    (snapshot / "traffic-0.jsonl").unlink()
    parent_dir = register_parent(cfg, tiny_target, tmp)
    url = start_endpoint(
        with_values(cfg, {"serving.drafter_version": "peagle-drafter/1"}), tiny_target, read_drafter(parent_dir)
    )
    model = tiny_target.name
    record_dir = Path(cfg.serving.record_dir or "")
    try:
        with Traffic(url, model, expected, "workload", count=len(WORKLOAD) * REPEATS) as recorded:
            recorded.join()
        deadline = time.monotonic() + 60  # the recorder writes off the request path: wait for its lines
        while recorded_lines(record_dir) < recorded.ok and time.monotonic() < deadline:
            time.sleep(0.2)
        shutil.copytree(record_dir, snapshot, dirs_exist_ok=True)
        try:
            run_adapt(with_values(cfg, {"adapt.min_requests": 10_000}))
        except ConfigError as err:
            refusals["too little traffic"] = str(err)
        with Traffic(url, model, expected, "during", pause_s=3.0) as during:  # paced (see Traffic)
            report = run_adapt(cfg)
        stats = speculative_stats(url)
        new_dir = Path(report.export_dir)
        broken = tmp / "broken"  # a drafter whose weights vLLM cannot load: its replica never starts
        shutil.copytree(new_dir, broken)
        (broken / "model.safetensors").write_bytes(b"not a safetensors file")
        (broken / "recommendation.json").unlink(missing_ok=True)  # served as the drafter, whatever adapt chose
        swap_error = ""
        with Traffic(url, model, expected, "failing", pause_s=3.0) as failing:
            try:
                swap_drafter(cfg, broken, "broken/0", (new_dir, "peagle-drafter/2"))
            except RuntimeError as err:
                swap_error = str(err)
        after_failure = speculative_stats(url)
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):  # continuous mode's round on the unchanged snapshot
            skipped = adapt_cycle(cfg)
        refusals["no new traffic"] = printed.getvalue()
        hybrid = with_values(cfg, {"serving.decoder": "hybrid", "serving.hybrid_threshold": 0.5})
        with Traffic(url, model, expected, "switching", pause_s=0.5) as switching:
            swap_drafter(hybrid, new_dir, "peagle-drafter/2", (new_dir, "peagle-drafter/2"))
            on_hybrid = switching.ok + 2 * len(WORKLOAD)  # every prompt seen by the new replica, then again
            deadline = time.monotonic() + 120
            while switching.ok < on_hybrid and time.monotonic() < deadline:
                time.sleep(0.2)
        hybrid_stats = settled_stats(url)
        with urllib.request.urlopen(f"{url}/metrics", timeout=30) as resp:
            hybrid_stats["metrics"] = resp.read().decode()
    finally:
        stop_endpoint()
    return AdaptLoop(
        cfg,
        tmp,
        report,
        recorded,
        during,
        failing,
        stats,
        after_failure,
        skipped,
        refusals,
        swap_error,
        switching,
        hybrid_stats,
    )


def settled_stats(url, timeout_s: float = 30) -> dict:
    """/v1/speculative_stats once the hybrid's counts per source (written by its engine core every 0.25 s)
    have caught up with vLLM's own."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = speculative_stats(url)
        counted = sum(source["drafts"] for source in stats.get("by_source", {}).values())
        if counted == stats["drafts"] or time.monotonic() > deadline:
            return stats
        time.sleep(0.3)


def speculative_stats(url) -> dict:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none").get("/speculative_stats", cast_to=object)
