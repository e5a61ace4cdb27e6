"""The adaptation loop end to end on the tiny target: the endpoint records its traffic, `adapt` fine-tunes
the registered drafter on it, judges both versions with stock vLLM, registers and promotes the new one and
swaps it into the running endpoint while requests keep flowing. Real Ray Serve, vLLM, Ray Train, MLflow."""

import json
import shutil
import threading
import time
from pathlib import Path

import openai
import pytest
import torch
from mlflow.tracking import MlflowClient

from peagle_ray.adapt import adapt_cycle, decide, regression_error, run_adapt, serve_adapting
from peagle_ray.bench import adapt_ablation
from peagle_ray.config import ConfigError, build_config, with_values
from peagle_ray.drafter.build import drafter_for_target
from peagle_ray.export.speculators import export_drafter, read_drafter
from peagle_ray.serve.app import free_port, start_endpoint, stop_endpoint, swap_drafter
from peagle_ray.tracking import register_export
from tests.test_serve import hf_greedy

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


def adapt_cfg(tmp, tiny_target, **adapt):
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


def register_parent(cfg, tiny_target, tmp) -> None:
    """A random (untrained) drafter registered as version 1, which takes the `serving` alias."""
    drafter, _, _ = drafter_for_target(
        tiny_target, cfg.drafter, torch.arange(516.0), 3, torch.Generator().manual_seed(0)
    )
    export = export_drafter(drafter, tmp / "parent-export", tiny_target, [2, 3, 5], K)
    assert register_export(cfg.tracking.tracking_uri, cfg, "served", export, tmp / "mlflow") == "1"


def test_promotion_rule():
    cfg = build_config({"adapt": {"min_gain": 0.05, "max_regression": 0.02}})

    def row(al, wrong=0):
        return {"acceptance_length": al, "greedy_mismatches": wrong}

    parent = {"heldout": row(1.2), "general": row(1.18)}
    assert decide(cfg, parent, {"heldout": row(1.65), "general": row(1.17)}) == {
        "gain": 0.45,
        "regression": 0.01,
        "promote": True,
        "why": "held-out gain and general-suite loss within bounds",
    }
    held = decide(cfg, parent, {"heldout": row(1.22), "general": row(1.1)})
    assert not held["promote"] and "gain +0.020 < adapt.min_gain 0.05" in held["why"]
    assert "mt-bench AL loss 0.080 > adapt.max_regression 0.02" in held["why"]
    assert "greedy outputs differ" in decide(cfg, parent, {"heldout": row(2), "general": row(1.2, 1)})["why"]


def test_a_general_suite_loss_within_its_noise_is_not_forgetting():
    cfg = build_config({"adapt": {"min_gain": 0.05, "max_regression": 0.02}})

    def general(*by_category):
        al = sum(by_category) / len(by_category)
        return {"acceptance_length": al, "greedy_mismatches": 0, "by_category": dict(enumerate(by_category))}

    assert regression_error(general(1.2, 1.3), general(1.1, 1.3)) == pytest.approx(0.05)
    assert regression_error({"acceptance_length": 1.2}, general(1.2)) is None
    heldout = ({"acceptance_length": 1.2, "greedy_mismatches": 0}, {"acceptance_length": 1.3, "greedy_mismatches": 0})
    parent = {"heldout": heldout[0], "general": general(1.20, 1.30, 1.10, 1.25)}
    # a 0.04 loss, but per category +0.12 ... -0.02: 2 standard errors (0.06) cover it -> promoted
    noisy = decide(cfg, parent, {"heldout": heldout[1], "general": general(1.08, 1.27, 1.12, 1.22)})
    assert noisy["promote"] and noisy["regression"] == pytest.approx(0.04)
    # the same 0.04 lost evenly in every category is measurable forgetting -> held back, saying so
    steady = decide(cfg, parent, {"heldout": heldout[1], "general": general(1.16, 1.26, 1.06, 1.21)})
    assert not steady["promote"] and "mt-bench AL loss 0.040 (+- 0.000 over its categories)" in steady["why"]


def test_continuous_mode_needs_a_recording_and_a_period():
    with pytest.raises(ConfigError, match="--adapt-every needs traffic to learn from: set serving.record_dir"):
        serve_adapting(build_config({}), None, None, 5)
    with pytest.raises(ConfigError, match="--adapt-every must be a positive number of minutes; got 0"):
        serve_adapting(build_config({"serving": {"record_dir": "r"}}), None, None, 0)


def test_adapt_refuses_without_a_recording(tmp_path):
    with pytest.raises(ConfigError, match="set serving.record_dir .* or adapt.traffic_dir; got neither"):
        run_adapt(build_config({}))
    with pytest.raises(ConfigError, match="tracking.registered_model must be set"):
        run_adapt(build_config({"serving": {"record_dir": str(tmp_path)}, "tracking": {"registered_model": None}}))
    with pytest.raises(FileNotFoundError, match="holds no recorded traffic"):
        run_adapt(build_config({"serving": {"record_dir": str(tmp_path)}}))


def speculative_stats(url) -> dict:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none").get("/speculative_stats", cast_to=object)


class Traffic:
    """Requests sent one after another from a thread until stopped, pause_s apart; each outcome kept. Paced
    traffic leaves the 2 cores to training and judging: vLLM's engine busy-polls for 1 s after each step
    (shm_broadcast busy_loop_s), so a request every second would keep a core spinning."""

    def __init__(self, url, model, expected: dict[str, list[int]], pause_s: float = 0.0):
        self.api = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
        self.model, self.expected, self.pause_s = model, expected, pause_s
        self.ok, self.failed, self.mismatched = 0, [], []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        i = 0
        while not self._stop.wait(self.pause_s):
            prompt = WORKLOAD[i % len(WORKLOAD)]
            i += 1
            try:
                out = self.api.completions.create(
                    model=self.model,
                    prompt=prompt,
                    max_tokens=TOKENS,
                    temperature=0,
                    extra_body={"ignore_eos": True, "return_token_ids": True},
                )
            except Exception as err:  # noqa: BLE001 - every failure is the finding
                self.failed.append(repr(err)[:300])
                continue
            self.ok += 1
            if out.choices[0].token_ids != self.expected[prompt]:
                self.mismatched.append(prompt)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(180)


def test_record_adapt_promote_and_swap_under_load(tiny_target, tmp_path, ray_local):
    from transformers import AutoTokenizer

    general = tmp_path / "general.jsonl"  # adapt.replay: general data mixed in, never judged as traffic
    chats = [
        [{"role": "user", "content": f"Tell me about {i}."}, {"role": "assistant", "content": f"{i} is {i}."}]
        for i in range(6)
    ]
    general.write_text("".join(json.dumps({"messages": m}) + "\n" for m in chats))
    cfg = adapt_cfg(tmp_path, tiny_target, replay=[str(general)])
    (tmp_path / "traffic").mkdir()
    with pytest.raises(ConfigError, match="no version of registered model 'peagle-drafter' has the alias 'serving'"):
        (tmp_path / "traffic" / "traffic-0.jsonl").write_text('{"schema": "peagle-traffic/1"}\n')
        run_adapt(cfg)
    register_parent(cfg, tiny_target, tmp_path)
    parent_dir = tmp_path / "parent-export"
    tokenizer = AutoTokenizer.from_pretrained(tiny_target)
    expected = {p: hf_greedy(tiny_target, tokenizer(p)["input_ids"], TOKENS) for p in WORKLOAD}
    served = with_values(cfg, {"serving.drafter_version": "peagle-drafter/1"})
    url = start_endpoint(served, tiny_target, read_drafter(parent_dir))
    model = tiny_target.name
    try:
        with Traffic(url, model, expected) as recorded:  # the workload, recorded by the endpoint
            while recorded.ok < len(WORKLOAD) * REPEATS:
                time.sleep(0.2)
        assert not recorded.failed and not recorded.mismatched
        with pytest.raises(ConfigError, match="too little recorded traffic"):
            run_adapt(with_values(cfg, {"adapt.min_requests": 10_000}))
        with Traffic(url, model, expected, pause_s=3.0) as during:  # paced (see Traffic)
            report = run_adapt(cfg)
        stats = speculative_stats(url)
        new_dir = Path(report["export_dir"])
        broken = tmp_path / "broken"  # a drafter whose weights vLLM cannot load: its replica never starts
        shutil.copytree(new_dir, broken)
        (broken / "model.safetensors").write_bytes(b"not a safetensors file")
        with Traffic(url, model, expected, pause_s=3.0) as failing:
            with pytest.raises(RuntimeError, match=f"{new_dir} keeps serving"):
                swap_drafter(cfg, broken, "broken/0", (new_dir, "peagle-drafter/2"))
        after_failure = speculative_stats(url)
        skipped = adapt_cycle(with_values(cfg, {"adapt.min_requests": 10_000}))  # continuous mode's round
    finally:
        stop_endpoint()
    assert failing.ok > 0 and failing.failed == [] and failing.mismatched == []
    assert after_failure["version"] == "peagle-drafter/2" and skipped is None
    print(report)
    heldout = {who: report["measured"][who]["heldout"] for who in ("parent", "new")}
    assert report["parent_version"] == "1" and report["version"] == "2" and report["k"] == K
    prepared = json.loads((Path(report["json"]).parent / "data" / "summary.json").read_text())["by_category"]
    assert report["samples"] == prepared["traffic"] and sum(prepared["user"].values()) == 6  # replay trained too
    # held-out requests are repeats of train prompts: the random drafter accepts nothing, the adapted one
    # learned them (+0.88, +0.67, +0.46 AL in three runs: the split follows random request ids)
    assert heldout["new"]["acceptance_length"] >= heldout["parent"]["acceptance_length"] + 0.3, heldout
    assert report["promote"] and report["swapped"], report["why"]
    verdict = json.loads((Path(report["export_dir"]) / "recommendation.json").read_text())  # from held-out timing
    assert verdict["draft"] == report["drafts"] and verdict["reason"] == report["recommendation"]
    assert "over 1 timed prompts" in verdict["reason"] or "fewer than 2 timed prompts" in verdict["reason"]
    assert all(report["measured"][w][p]["greedy_mismatches"] == 0 for w in heldout for p in ("heldout", "general"))
    assert during.ok > 0 and during.failed == [] and during.mismatched == []  # nothing dropped in the swap
    assert stats["version"] == "peagle-drafter/2" and stats["drafter"] == report["export_dir"]
    # bench adapt-ablation on this adaptation's own inputs (the general side: its replayed records)
    work = Path(report["json"]).parent
    variants = [["base"], ["decoder only", "drafter.frozen=[embed_tokens, fc]"], ["replay", "replay=0.2"]]
    ablation = adapt_ablation.run(
        with_values(cfg, {"capture.output_dir": str(work / "hidden")}), work, variants, [2, 4]
    )
    rows = {name: v["rows"] for name, v in ablation["variants"].items()}
    assert [r["steps"] for r in rows["base"]] == [2, 4] and set(ablation["parent"]) == {"heldout_al", "general_al"}
    assert rows["decoder only"][0]["trainable_parameters"] < rows["base"][0]["trainable_parameters"]
    assert ablation["variants"]["replay"]["train_records"] > ablation["variants"]["base"]["train_records"]
    assert all(r["heldout_al"] >= 1 and r["general_al"] >= 1 for v in rows.values() for r in v)
    client = MlflowClient(cfg.tracking.tracking_uri)
    version = client.get_model_version_by_alias("peagle-drafter", "serving")
    assert str(version.version) == "2" and version.tags["parent_version"] == "1" and version.tags["promoted"] == "True"
    assert float(version.tags["adapt/heldout_al"]) == pytest.approx(heldout["new"]["acceptance_length"])
