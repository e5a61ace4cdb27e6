"""The endpoint under traffic, as users meet it (issue 46): every decoder (target alone, drafter, suffix
decoding, hybrid) with configs/demo.yaml's serving settings (drafting only at batch 1) answers 1, 2, 8 and 32
concurrent clients with no error and the target's own greedy tokens; then its engine is killed under load:
503 with Retry-After while Serve replaces the replica, then 200 again, no request left hanging."""

import json
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest
from ray import serve
from transformers import AutoTokenizer

from peagle_ray.config import load_config
from peagle_ray.export.speculators import read_drafter
from peagle_ray.serve.app import APP_NAME, RETRY_AFTER_S, free_port, start_endpoint, stop_endpoint
from tests.test_serve import drafter_dir, hf_greedy  # noqa: F401 - drafter_dir is a fixture

REPO = Path(__file__).resolve().parents[1]
PROMPTS = [
    "def read_file(path):",
    "The socket module provides",
    "import os\nimport sys\n",
    "class Stack:\n    def push(self, x):",
    "Once upon a time",
    "SELECT name FROM users WHERE",
    "for i in range(10):",
    "The capital of France is",
]
TOKENS = 16
CLIENTS = (1, 2, 8, 32)
RECOVERY_S = 480  # the longest a killed engine's replacement, or a request waiting for it, may take (below)
DECODERS = ("target", "drafter", "hybrid", "suffix")  # suffix last: the demo's endpoint, then killed under load


@pytest.fixture(scope="module")
def expected(tiny_target) -> dict[str, list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(tiny_target)
    return {p: hf_greedy(tiny_target, tokenizer(p)["input_ids"], TOKENS) for p in PROMPTS}


@pytest.fixture(scope="module")
def deploy(tiny_target, drafter_dir, ray_local):  # noqa: F811 - the fixture imported above
    """deploy(decoder) -> URL: the endpoint on configs/demo.yaml's serving settings, serving `decoder` (one
    application, redeployed per decoder as a user's `serving.decoder` would)."""
    port = free_port()

    def run(decoder: str) -> str:
        cfg = load_config(
            REPO / "configs" / "demo.yaml",
            [
                f"target.path={tiny_target}",
                "target.max_model_len=512",
                "target.kv_cache_gib=1",
                f"serving.port={port}",
                f"serving.decoder={decoder}",
                "serving.num_speculative_tokens=3",
            ],
        )
        assert cfg.serving.draft_max_batch_size == 1  # demo.yaml's: the cutoff that killed suffix decoding
        return start_endpoint(cfg, tiny_target, read_drafter(drafter_dir))

    yield run
    stop_endpoint()


def complete(url: str, model: str, prompt: str, timeout_s: float = 120) -> tuple[int, dict, dict]:
    """(status, body, headers) of one greedy completion of TOKENS tokens; status 0: no answer in time."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    request = urllib.request.Request(
        f"{url}/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            return resp.status, json.loads(resp.read()), {k.lower(): v for k, v in resp.headers.items()}
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}"), {k.lower(): v for k, v in err.headers.items()}
    except (urllib.error.URLError, TimeoutError, ConnectionError) as err:
        return 0, {"error": str(err)}, {}


def stats(url: str) -> dict:
    with urllib.request.urlopen(f"{url}/v1/speculative_stats", timeout=30) as resp:
        return json.loads(resp.read())


@pytest.mark.parametrize("decoder", DECODERS)
def test_every_decoder_answers_concurrent_clients_losslessly(deploy, decoder, expected, tiny_target):
    url = deploy(decoder)
    model = tiny_target.name
    assert stats(url)["decoder"] == decoder
    for clients in CLIENTS:
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(clients)]
        with ThreadPoolExecutor(clients) as pool:
            answers = list(pool.map(lambda p: complete(url, model, p), prompts))
        failed = [(status, body) for status, body, _ in answers if status != 200]
        assert not failed, f"{decoder} at {clients} clients: {failed[:3]}"
        wrong = [
            p
            for p, (_, body, _) in zip(prompts, answers, strict=True)
            if body["choices"][0]["token_ids"] != expected[p]
        ]
        assert not wrong, f"{decoder} at {clients} clients: greedy output differs from the target's for {wrong}"
    after = stats(url)
    assert after["decoder"] == decoder
    if decoder in ("drafter", "hybrid"):
        assert after["drafts"] > 0  # it drafted (at batch 1), and stayed lossless above the cutoff
    with urllib.request.urlopen(f"{url}/health", timeout=30) as resp:
        assert resp.status == 200


def engine_processes() -> list[psutil.Process]:
    """The vLLM engine-core processes under the endpoint's Serve replica (of this test process's own local
    Ray cluster, whose raylet and workers are its descendants: another Ray cluster on the machine is not ours)."""
    found = []
    for proc in psutil.Process().children(recursive=True):
        if "ServeReplica:peagle-openai" in title(proc):
            found += [c for c in proc.children(recursive=True) if "EngineCore" in title(c)]
    return found


def deployment_state() -> str:
    """The endpoint deployment's status, replica states and message, as serve.status() gives them."""
    deployment = serve.status().applications[APP_NAME].deployments["OpenAIEndpoint"]
    return f"{deployment.status} {dict(deployment.replica_states)} {deployment.message[:2000]}"


def title(process: psutil.Process) -> str:
    """A process's name and command line; "" once it has exited (a replica being replaced: zombie, gone)."""
    try:
        return " ".join([process.name(), *process.cmdline()])
    except psutil.Error:
        return ""


def test_a_killed_engine_costs_503s_then_the_endpoint_serves_again(deploy, expected, tiny_target):
    """After test_every_decoder_...[suffix]: the demo's endpoint (suffix decoding) under 8 clients' load.

    How long the replacement takes is the machine's, not a pass mark (it is printed, with what Serve said of the
    deployment meanwhile): 32-91 s from the kill on this 2-core box alone or beside one other test file, over
    100 s beside the other xdist worker's engines (a clean-clone run on 2026-12-07: the new replica began
    initialising 41 s after Serve added it), and once (CI, 2026-12-07) no 200 within 240 s. Between the dead
    replica's stop and the new one's start, Serve's proxy holds requests until a replica can take them;
    RECOVERY_S bounds both that wait and the recovery, so that a replacement that never comes, or a request
    that never returns, still fails the test."""
    url, model = deploy("suffix"), tiny_target.name  # redeploying the same decoder keeps the running replica
    [engine] = engine_processes()
    answers: list[tuple[float, int, dict, dict, float]] = []  # (sent, status, body, headers, seconds)
    stop, mismatched = threading.Event(), []

    def client(i: int) -> None:
        while not stop.is_set():
            prompt, sent = PROMPTS[i % len(PROMPTS)], time.monotonic()
            status, body, headers = complete(url, model, prompt, timeout_s=RECOVERY_S)
            answers.append((sent, status, body, headers, time.monotonic() - sent))
            if status == 200 and body["choices"][0]["token_ids"] != expected[prompt]:
                mismatched.append(prompt)
            elif status != 200:
                time.sleep(0.5)

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(8)]
    for t in threads:
        t.start()
    time.sleep(3)
    killed = time.monotonic()
    engine.kill()
    deadline, timeline = killed + RECOVERY_S, []  # what Serve said of the deployment, when it changed
    while time.monotonic() < deadline and not any(s == 200 and sent > killed + 1 for sent, s, *_ in answers):
        if (state := deployment_state()) != (timeline[-1][1] if timeline else None):
            timeline.append((round(time.monotonic() - killed), state))
        time.sleep(0.5)
    time.sleep(2)
    stop.set()
    for t in threads:
        t.join(timeout=RECOVERY_S + 20)
    after = [a for a in answers if a[0] > killed]
    recovered = [sent + seconds - killed for sent, status, _, _, seconds in after if status == 200]  # answered at
    assert recovered, f"no 200 within {RECOVERY_S} s of the kill: {[a[1] for a in after]}; Serve said: {timeline}"
    print(f"killed engine: Serve's deployment (seconds after the kill, state): {timeline}")
    print(f"killed engine: the first 200 answered {min(recovered):.0f} s after the kill; {len(after)} requests sent")
    unavailable = [a for a in after if a[1] == 503]
    assert unavailable, "no 503 while the engine was dead"
    for _, _, body, headers, _ in unavailable:
        assert headers.get("retry-after") == str(RETRY_AFTER_S), headers
        assert "vLLM engine died" in body["error"]["message"], body
    assert {a[1] for a in answers} <= {200, 503}, [(a[1], a[2]) for a in answers if a[1] not in (200, 503)][:3]
    assert not [a for a in answers if a[4] > RECOVERY_S], "a request hung past its timeout"
    assert not any(t.is_alive() for t in threads) and not mismatched
    status, body, _ = complete(url, model, PROMPTS[0])
    assert status == 200 and body["choices"][0]["token_ids"] == expected[PROMPTS[0]]
    assert stats(url)["decoder"] == "suffix" and engine_processes() and engine not in engine_processes()
