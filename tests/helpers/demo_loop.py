"""The demo's run, once per test session, with the adaptation loop's live checks inside it, driven stage by
stage by conftest's demo_recorded, demo_adapted and demo_loop (DemoLoop), for the tests that each check one
part (tests/test_demo.py, tests/test_adapt.py, tests/test_bench_adapt.py). `peagle-ray demo` on a tiny target of a family users bring (Llama-3.x: llama3
rope, 128,256 rows, untied head): the built-in suite's prompts (4 of each category) regenerated into data, captured from the
Serve-hosted target, a general P-EAGLE drafter trained in Ray Train and registered, served with recording on,
the demo's workload sent through it; then, at the adapt stage (demo_steps' "adapt" step), a narrow workload whose
greedy answers are known is sent and snapshotted, and paced requests flow while `adapt` fine-tunes the
drafter on it, judges both versions with stock vLLM, promotes and swaps; and, once the demo is done
(its "ready" step, _Live.on_ready), a drafter that cannot load is swapped in (and refused), continuous mode's round with no new
traffic is skipped, and the endpoint switches to the hybrid under load. Real Ray Serve, vLLM, Ray Train,
MLflow (the demo's own server)."""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import os
import shutil
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import openai

from peagle_ray.adapt import adapt_cycle, run_adapt
from peagle_ray.config import ConfigError, PeagleConfig, build_config, with_values
from peagle_ray.data.suite import CATEGORIES, builtin_conversations
from peagle_ray.demo import DemoResult, demo_steps
from peagle_ray.serve.app import free_port, swap_drafter
from tests.helpers.demo_workload import DEMO_REQUESTS, REPEATS, TOKENS, WORKLOAD, K


def demo_cfg(tmp: Path, target: Path) -> PeagleConfig:
    """The demo at a tiny budget; the adaptation's at the loop's (adapt.max_steps steps, one worker)."""
    general = tmp / "general.jsonl"  # adapt.replay: general data mixed in, never judged as traffic
    chats = [
        [{"role": "user", "content": f"Tell me about {i}."}, {"role": "assistant", "content": f"{i} is {i}."}]
        for i in range(6)
    ]
    general.write_text("".join(json.dumps({"messages": m}) + "\n" for m in chats))
    builtin = tmp / "builtin-subset.jsonl"  # the general drafter trains 4 steps of 4 sequences: the built-in
    # suite's first 4 prompts of each category are plenty (all 320 cost ~1 min of regeneration and capture)
    subset = (c for category in CATEGORIES for c in itertools.islice(builtin_conversations((category,)), 4))
    builtin.write_text("".join(json.dumps({"messages": c.messages}) + "\n" for c in subset))
    return build_config(
        {
            "target": {"path": str(target), "max_model_len": 512, "kv_cache_gib": 1},
            "data": {
                "sources": [str(builtin)],
                "max_length": 160,
                "validation_fraction": 0.25,
                "regenerate": True,
                "max_new_tokens": 16,
                "output_dir": str(tmp / "data"),
            },
            "capture": {"mode": "offline", "output_dir": str(tmp / "hidden")},
            "drafter": {"num_depths": K, "draft_vocab_size": 512},
            "training": {
                "num_workers": 1,
                "max_steps": 4,
                "learning_rate": 3e-3,
                "warmup_steps": 10,
                "sequences_per_step": 4,
                "segment_length": 64,
                "validate_every": 1000,
                "epochs": 1000,
                "storage_path": str(tmp / "runs"),
            },
            "tracking": {"port": free_port()},
            # K asked for: served with the drafter even where its measured verdict is the target alone (the
            # tiny target decodes faster than any drafter saves), so that every swap loads a drafter
            "serving": {"port": free_port(), "log_dir": str(tmp / "logs"), "num_speculative_tokens": K},
            "eval": {"suite": "mt-bench", "prompts_per_category": 1, "timing_prompts": 2, "max_new_tokens": TOKENS},
            # adapt reads a snapshot of the recording taken at the adapt stage, not what later requests add
            "adapt": {
                "max_steps": 120,
                "min_requests": 8,
                "validation_fraction": 0.25,
                "replay": [str(general)],
                "traffic_dir": str(tmp / "traffic-snapshot"),
            },
            "demo": {"workload": "builtin-coding", "requests": DEMO_REQUESTS, "max_tokens": 8},
        }
    )


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


def recorded_lines(directory: Path) -> int:
    return sum(1 for f in directory.glob("*.jsonl") for _ in f.open())


class _Live:
    """What the hooks saw and sent while the demo ran (run_loop's parts, in the order they happen)."""

    def __init__(self, target: Path, expected: dict[str, list[int]]):
        self.expected, self.model = expected, target.name
        self.cfg: PeagleConfig | None = None  # the run's config, as the last stage hook saw it
        self.refusals: dict[str, str] = {}
        self.recorded: Traffic | None = None
        self.during: Traffic | None = None
        self.failing: Traffic | None = None
        self.switching: Traffic | None = None
        self.answers: list = []
        self.stats: dict = {}
        self.after_failure: dict = {}
        self.skipped: object = None
        self.swap_error = ""
        self.hybrid_stats: dict = {}

    def on_stage(self, name: str, cfg: PeagleConfig, url: str | None) -> None:
        self.cfg = cfg
        snapshot = Path(cfg.adapt.traffic_dir or "")
        if name == "data":  # MLflow is up, nothing is registered: adapt has no version to start from
            snapshot.mkdir(parents=True)
            (snapshot / "traffic-0.jsonl").write_text('{"schema": "peagle-traffic/1"}\n')
            try:
                run_adapt(cfg)
            except ConfigError as err:
                self.refusals["no alias"] = str(err)
            (snapshot / "traffic-0.jsonl").unlink()
        elif name == "adapt":  # the endpoint serves the general drafter, the demo's workload is recorded
            assert url is not None
            record_dir = Path(cfg.serving.record_dir or "")
            with Traffic(url, self.model, self.expected, "workload", count=len(WORKLOAD) * REPEATS) as recorded:
                recorded.join()
            deadline = time.monotonic() + 60  # the recorder writes off the request path: wait for its lines
            while recorded_lines(record_dir) < recorded.ok + DEMO_REQUESTS and time.monotonic() < deadline:
                time.sleep(0.2)
            shutil.copytree(record_dir, snapshot, dirs_exist_ok=True)
            try:
                run_adapt(with_values(cfg, {"adapt.min_requests": 10_000}))
            except ConfigError as err:
                self.refusals["too little traffic"] = str(err)
            self.recorded = recorded
            # paced (see Traffic) through adapt and its swap, until the demo is done (on_ready)
            self.during = Traffic(url, self.model, self.expected, "during", pause_s=3.0).__enter__()

    def end_during(self) -> None:
        if self.during is not None:
            self.during.__exit__(None, None, None)

    def on_ready(self, url: str) -> None:
        """The demo is done, its endpoint live: the chat a user would send, then the loop's live checks."""
        assert self.cfg is not None
        cfg = self.cfg
        self.end_during()
        body = {"model": self.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
        request = urllib.request.Request(
            f"{url}/v1/chat/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=120) as resp:
            answer = json.loads(resp.read())["choices"][0]["message"]["content"]
        stats = speculative_stats(url)
        self.answers, self.stats = [answer, stats], stats
        served, served_label = Path(stats["drafter"]), stats["version"]
        broken = Path(tempfile.mkdtemp(prefix="broken-", dir=cfg.training.storage_path))
        shutil.copytree(served, broken, dirs_exist_ok=True)  # weights vLLM cannot load: its replica never starts
        (broken / "model.safetensors").write_bytes(b"not a safetensors file")
        (broken / "recommendation.json").unlink(missing_ok=True)  # served as the drafter, whatever adapt chose
        with Traffic(url, self.model, self.expected, "failing", pause_s=3.0) as failing:
            try:
                swap_drafter(cfg, broken, "broken/0", (served, served_label))
            except RuntimeError as err:
                self.swap_error = str(err)
        self.failing, self.after_failure = failing, speculative_stats(url)
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):  # continuous mode's round on the unchanged snapshot
            self.skipped = adapt_cycle(cfg)
        self.refusals["no new traffic"] = printed.getvalue()
        hybrid = with_values(cfg, {"serving.decoder": "hybrid", "serving.hybrid_threshold": 0.5})
        with Traffic(url, self.model, self.expected, "switching", pause_s=0.5) as switching:
            swap_drafter(hybrid, served, served_label, (served, served_label))
            on_hybrid = switching.ok + 2 * len(WORKLOAD)  # every prompt seen by the new replica, then again
            deadline = time.monotonic() + 120
            while switching.ok < on_hybrid and time.monotonic() < deadline:
                time.sleep(0.2)
        self.switching = switching
        hybrid_stats = settled_stats(url)
        with urllib.request.urlopen(f"{url}/metrics", timeout=30) as resp:
            hybrid_stats["metrics"] = resp.read().decode()
        self.hybrid_stats = hybrid_stats


class DemoLoop:
    """The demo's run (demo.demo_steps) driven stage by stage by the session's fixtures (conftest: demo_recorded,
    demo_adapted, demo_loop), with _Live's checks at each step, so that each stage's tests run once it is done
    and no test's setup waits for the whole run. pytest's `capture_manager` is suspended while the demo runs,
    and what a person at the console would see (file descriptors 1 and 2, from any process) is kept."""

    def __init__(self, target: Path, tmp: Path, expected: dict[str, list[int]], capture_manager=None):
        self.tmp = tmp
        self.live = _Live(target, expected)
        self.steps = demo_steps(demo_cfg(tmp, target))
        self.capture_manager = capture_manager
        self.console = ""  # what a person at the console saw, so far
        self.outcome: DemoResult | None = None
        self.url: str | None = None

    def advance(self, until: str) -> None:
        """Run the demo to its step `until` ("adapt" or "ready"), doing the checks of the steps on the way."""
        with self._watched():
            for step in self.steps:
                self.url = step.url
                if step.name in ("data", "adapt"):
                    self.live.on_stage(step.name, step.cfg, step.url)
                self.outcome = step.result
                if step.name == until:
                    return
        raise AssertionError(f"the demo ended before its step {until!r}")

    def finish(self) -> None:
        """The live checks on the finished demo's endpoint (_Live.on_ready), then the demo run to its end (the
        endpoint, Ray and MLflow stopped)."""
        assert self.url is not None, "finish() before advance('ready')"
        with self._watched():
            try:
                self.live.on_ready(self.url)
                next(self.steps, None)  # the demo's end: the endpoint, Ray and MLflow stopped
                live = self.live
                assert live.cfg is not None and live.recorded and live.during and live.failing and live.switching
            finally:
                self.close()

    def close(self) -> None:
        self.live.end_during()
        self.steps.close()

    @contextlib.contextmanager
    def _watched(self):
        """pytest's own capture off (print() writes to descriptor 1 again), descriptors 1 and 2 kept as the
        console (console.txt, also when a stage fails)."""
        manager = self.capture_manager
        suspended = manager.global_and_fixture_disabled() if manager else contextlib.nullcontext()
        console = _Captured()
        try:
            with suspended, _console() as console:
                yield
        finally:
            self.console += console.text
            (self.tmp / "console.txt").write_text(self.console)

    @property
    def cfg(self) -> PeagleConfig:
        """The run's config, its tracking URI the MLflow store itself (readable after the demo's server stopped)."""
        cfg = self.live.cfg
        assert cfg is not None
        storage = Path(cfg.training.storage_path)
        return with_values(cfg, {"tracking.tracking_uri": f"sqlite:///{storage / 'mlflow' / 'mlflow.db'}"})

    @property
    def report(self):
        assert self.outcome is not None
        return self.outcome.adapt

    def __getattr__(self, name: str):  # what _Live saw and sent: recorded, during, stats, refusals, ...
        return getattr(self.__dict__["live"], name)


class _Captured:
    text = ""


@contextlib.contextmanager
def _console():
    """What a person at the console sees, from any process: file descriptors 1 and 2 into a file, restored after."""
    captured = _Captured()
    with tempfile.TemporaryFile(mode="w+b") as sink:
        saved = os.dup(1), os.dup(2)
        sys.stdout.flush(), sys.stderr.flush()
        os.dup2(sink.fileno(), 1), os.dup2(sink.fileno(), 2)
        try:
            yield captured
        finally:
            sys.stdout.flush(), sys.stderr.flush()
            os.dup2(saved[0], 1), os.dup2(saved[1], 2)
            os.close(saved[0]), os.close(saved[1])
            sink.seek(0)
            captured.text = sink.read().decode(errors="replace")


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
