"""The REST endpoint: the tiny target + an exported tiny drafter in Ray Serve, talked to with the OpenAI
client and raw HTTP. Greedy outputs must equal the target's own greedy decoding (float32)."""

import json
import stat
import time
import urllib.error
import urllib.request

import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from peagle_ray.config import build_config
from peagle_ray.data.prepare import BadRows
from peagle_ray.data.sources import read_conversations
from peagle_ray.drafter.build import drafter_for_target
from peagle_ray.export.speculators import export_drafter, read_drafter
from peagle_ray.serve.app import RequestLimits, free_port, start_endpoint, stop_endpoint, vllm_args
from peagle_ray.serve.decoder import served_decoder
from peagle_ray.serve.limits import Limits

TOKEN = "test-token-123"
PROMPTS = ["def read_file(path):", "The socket module provides", "import os\nimport sys\n"]


@pytest.fixture(scope="module")
def drafter_dir(tiny_target, tmp_path_factory):
    cfg = build_config({"drafter": {"num_depths": 3, "draft_vocab_size": 400}})
    drafter, _, _ = drafter_for_target(
        tiny_target, cfg.drafter, torch.arange(516.0), 3, torch.Generator().manual_seed(0)
    )
    return export_drafter(drafter, tmp_path_factory.mktemp("served") / "drafter", tiny_target, [2, 3, 5], 3)


@pytest.fixture(scope="module")
def record_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("recorded") / "traffic"


@pytest.fixture(scope="module")
def endpoint(tiny_target, drafter_dir, record_dir, ray_local):
    serving = {
        "port": free_port(),
        "api_token": TOKEN,
        "max_tokens_limit": 64,
        "max_prompt_tokens": 200,
        "draft_max_batch_size": 2,  # the batch cutoff: above 2 running requests, the target alone decodes
    }
    cfg = build_config(
        {
            "target": {"path": str(tiny_target), "max_model_len": 512, "kv_cache_gib": 1},
            "serving": {**serving, "record_dir": str(record_dir), "drafter_version": "peagle-drafter/7"},
        }
    )
    url = start_endpoint(cfg, tiny_target, read_drafter(drafter_dir) if drafter_dir else None)
    yield url, tiny_target.name
    stop_endpoint()


def client(url, token=TOKEN):
    return openai.OpenAI(base_url=f"{url}/v1", api_key=token, max_retries=0)


def hf_greedy(target, prompt_ids: list[int], n: int) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(prompt_ids) :].tolist()


def post(url, path, body, token=TOKEN, raw: bytes | None = None):
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
    request = urllib.request.Request(
        url + path, data=raw if raw is not None else json.dumps(body).encode(), headers=headers
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")


def test_completions_chat_and_streaming_equal_target_greedy(endpoint, tiny_target):
    url, model = endpoint
    tokenizer = AutoTokenizer.from_pretrained(tiny_target)
    api = client(url)
    assert [m.id for m in api.models.list().data] == [model]
    for prompt in PROMPTS:
        ids = tokenizer(prompt)["input_ids"]
        result = api.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=24,
            temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        assert result.choices[0].token_ids == hf_greedy(tiny_target, ids, 24), prompt
        streamed = api.completions.create(
            model=model, prompt=prompt, max_tokens=24, temperature=0, stream=True, extra_body={"ignore_eos": True}
        )
        assert "".join(chunk.choices[0].text for chunk in streamed) == result.choices[0].text
    messages = [{"role": "user", "content": "How do I open a file?"}]
    chat_ids = tokenizer(
        tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), add_special_tokens=False
    )["input_ids"]
    chat = api.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=20,
        temperature=0,
        extra_body={"ignore_eos": True, "skip_special_tokens": False},
    )
    expected = tokenizer.decode(hf_greedy(tiny_target, chat_ids, 20), skip_special_tokens=False)
    assert chat.choices[0].message.content == expected
    pieces = api.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=20,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True, "skip_special_tokens": False},
    )
    assert "".join(c.choices[0].delta.content or "" for c in pieces if c.choices) == expected


def stats_of(url) -> dict:
    request = urllib.request.Request(f"{url}/v1/speculative_stats", headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(request, timeout=30) as resp:
        return json.loads(resp.read())


def test_above_the_batch_cutoff_the_target_decodes_alone_and_stays_lossless(endpoint, tiny_target):
    url, model = endpoint
    tokenizer = AutoTokenizer.from_pretrained(tiny_target)
    api = client(url)
    before = stats_of(url)["drafts"]
    api.completions.create(
        model=model, prompt=PROMPTS[0], max_tokens=16, temperature=0, extra_body={"ignore_eos": True}
    )
    alone = stats_of(url)["drafts"] - before
    prompts = [*PROMPTS, "class Server:"]  # 4 requests in one batch: above draft_max_batch_size = 2
    batch = api.completions.create(
        model=model,
        prompt=prompts,
        max_tokens=16,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    batched = stats_of(url)["drafts"] - before - alone
    for choice in batch.choices:
        ids = tokenizer(prompts[choice.index])["input_ids"]
        assert choice.token_ids == hf_greedy(tiny_target, ids, 16), prompts[choice.index]
    # alone: a draft at every step (16 tokens, >= 16 / (K + 1) steps); drafting at batch 4 would be >= 16
    assert alone >= 4 and batched < 4, (alone, batched)


def test_the_local_cluster_gives_serves_proxy_time_to_start(endpoint):
    """Ray's processes inherit the settings a locally started cluster is given (peagle_ray.cluster)."""
    import os

    import ray

    from peagle_ray.cluster import LOCAL_CLUSTER_ENV

    seen = ray.get(ray.remote(lambda: {name: os.environ.get(name) for name in LOCAL_CLUSTER_ENV}).remote())
    assert seen == LOCAL_CLUSTER_ENV


def test_speculative_stats_as_json_and_prometheus(endpoint):
    url, model = endpoint
    client(url).completions.create(model=model, prompt="def main():", max_tokens=16, temperature=0)
    stats = stats_of(url)
    assert stats["version"] == "peagle-drafter/7"
    assert stats["algorithm"] == "peagle" and stats["drafts"] > 0 and stats["draft_tokens"] == 3 * stats["drafts"]
    assert len(stats["acceptance_per_position"]) == 3
    assert stats["acceptance_length"] == pytest.approx(1 + stats["accepted_tokens"] / stats["drafts"])
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    assert "peagle_acceptance_length " in text and "vllm:spec_decode_num_drafts_total" in text
    with urllib.request.urlopen(f"{url}/health", timeout=30) as resp:
        assert resp.status == 200


def recorded(record_dir, match, count: int, timeout_s: float = 30) -> list[dict]:
    """The recorded requests `match` accepts, once `count` of them are on disk (the replica writes them off
    the request path, so they land a moment after the response)."""
    deadline = time.monotonic() + timeout_s
    while True:
        rows = [json.loads(line) for path in sorted(record_dir.glob("traffic-*.jsonl")) for line in path.open()]
        found = [r for r in rows if match(r)]
        if len(found) >= count or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


def test_traffic_is_recorded_as_the_target_saw_and_said_it(endpoint, record_dir, tiny_target):
    url, model = endpoint
    api = client(url)
    tokenizer = AutoTokenizer.from_pretrained(tiny_target)
    messages = [{"role": "user", "content": "Please record this question."}]
    api.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True, "metadata": {"conversation_id": "conv-1"}},
    )
    streamed = api.completions.create(
        model=model,
        prompt="def recorded(x):",
        max_tokens=10,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    assert "".join(chunk.choices[0].text for chunk in streamed)
    [chat] = recorded(record_dir, lambda r: r["conversation_id"] == "conv-1", 1)
    [completion] = recorded(record_dir, lambda r: r["prompt"] == "def recorded(x):", 1)
    chat_ids = tokenizer(
        tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), add_special_tokens=False
    )["input_ids"]
    assert chat["route"] == "chat" and chat["messages"] == messages and chat["prompt_ids"] == chat_ids
    assert chat["output_ids"] == [hf_greedy(tiny_target, chat_ids, 12)] and chat["sampling"]["temperature"] == 0
    assert chat["model"] == model and chat["drafter"]["algorithm"] == "peagle"
    assert chat["drafter"]["version"] == "peagle-drafter/7"
    prompt_ids = tokenizer("def recorded(x):")["input_ids"]
    assert completion["route"] == "completion" and completion["prompt_ids"] == prompt_ids
    assert completion["output_ids"] == [hf_greedy(tiny_target, prompt_ids, 10)]  # streamed deltas, joined
    files = list(record_dir.glob("traffic-*.jsonl"))
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in files)
    assert not any(TOKEN in p.read_text() or "Bearer" in p.read_text() for p in files)  # never headers
    bad = BadRows()
    conversations = list(read_conversations([f"traffic:{record_dir}"], 0.0, bad))
    assert bad.total() == 0 and any(c.output_ids == chat["output_ids"][0] for c in conversations)


BAD_REQUESTS = [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 1000}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "word " * 400, "max_tokens": 4}, 400, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 400}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": "not a list", "max_tokens": 4}, 400, None),
    ("/v1/completions", [1, 2, 3], 400, "JSON object"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 4, "temperature": "hot"}, 400, None),
    (
        "/v1/completions",
        {"prompt": "hi", "n": 1000},
        400,
        "n must be an integer between 1 and 8 (serving.max_n); got 1000",
    ),
    (
        "/v1/completions",
        {"prompt": "hi", "best_of": 50, "max_tokens": 2},
        400,
        "best_of must be an integer between 1 and 8",
    ),
    ("/v1/completions", {"prompt": "hi", "n": 4, "max_tokens": 32}, 400, "32 x 4 x 1 = 128 tokens; the limit is 64"),
    ("/v1/completions", {"prompt": ["a", "b", "c"], "max_tokens": 30}, 400, "30 x 1 x 3 = 90 tokens"),
    ("/v1/completions", {"prompt": ["hi"] * 20, "max_tokens": 1}, 400, "prompt holds 20 prompts; the limit is 16"),
    (
        "/v1/completions",
        {"prompt": "hi", "max_tokens": 2, "logprobs": 100},
        400,
        "logprobs must be an integer between 0 and 20",
    ),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "prompt_logprobs": 21}, 400, "prompt_logprobs must be"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "logprobs": True, "top_logprobs": 99},
        400,
        "top_logprobs must be an integer between 0 and 20",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "nobody", "content": "hi"}], "max_tokens": 2},
        400,
        "messages[0].role must be one of system, developer, user, assistant, tool, function; got 'nobody'",
    ),
]


@pytest.mark.parametrize("path,body,status,words", BAD_REQUESTS)
def test_bad_requests_get_4xx_and_the_server_keeps_serving(endpoint, path, body, status, words):
    url, model = endpoint
    if isinstance(body, dict):
        body = {"model": model, **body}
    code, answer = post(url, path, body)
    assert code == status, answer
    assert "error" in answer and (words is None or words in answer["error"]["message"]), answer
    code, good = post(url, "/v1/completions", {"model": model, "prompt": "hi", "max_tokens": 4})
    assert code == 200 and good["choices"][0]["text"] is not None


def test_malformed_json_and_unknown_model(endpoint):
    url, model = endpoint
    assert post(url, "/v1/completions", None, raw=b"{not json")[0] == 400
    assert post(url, "/v1/completions", {"model": "nope", "prompt": "hi", "max_tokens": 4})[0] == 404


def test_auth_rejects_missing_and_wrong_tokens(endpoint):
    url, model = endpoint
    body = {"model": model, "prompt": "hi", "max_tokens": 4}
    assert post(url, "/v1/completions", body, token=None)[0] == 401
    assert post(url, "/v1/completions", body, token="wrong")[0] == 401
    with pytest.raises(openai.AuthenticationError):
        client(url, token="wrong").models.list()
    assert post(url, "/v1/completions", body)[0] == 200


def test_auth_is_off_by_default_and_loopback_is_the_default_host(tiny_target, drafter_dir):
    cfg = build_config({})
    assert cfg.serving.host == "127.0.0.1" and cfg.serving.api_token is None
    args = vllm_args(cfg, tiny_target, served_decoder(read_drafter(drafter_dir)))
    assert "--api-key" not in args and "--trust-remote-code" not in args
    assert args[args.index("--load-format") + 1] == "safetensors"
    spec = json.loads(args[args.index("--speculative-config") + 1])
    assert spec["parallel_drafting"] is True and spec["num_speculative_tokens"] == 3


def test_the_same_endpoint_deployed_again_keeps_its_version(tiny_target, drafter_dir):
    """swap_drafter's way back deploys what already runs: the same version, so Serve restarts nothing."""
    from peagle_ray.serve.app import endpoint_app

    def version(cfg, drafter, **kwargs):
        app = endpoint_app(cfg, tiny_target, drafter, **kwargs)
        return app._bound_deployment.version  # noqa: SLF001 - what Serve compares between deploys

    cfg = build_config({})
    drafter = read_drafter(drafter_dir)
    first = version(cfg, drafter)
    assert first is not None and version(build_config({}), read_drafter(drafter_dir)) == first
    assert version(cfg, drafter, start_attempts=1) == first  # a deployment setting, not what the replica runs
    assert version(cfg, None) != first  # the target alone
    assert version(build_config({"serving": {"max_prompt_tokens": 100}}), drafter) != first


def test_drafter_with_pickled_weights_is_refused(drafter_dir, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((drafter_dir / "config.json").read_text())
    (bad / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(ValueError, match="safetensors only"):
        read_drafter(bad)


def test_request_limits_check_without_a_server(tiny_target):
    limits = RequestLimits(None, AutoTokenizer.from_pretrained(tiny_target), Limits(5, 8, 2, 5, 4, 16))
    assert limits.check(b'{"prompt": [1, 2, 3], "max_tokens": 8}', "/v1/completions") == (
        None,
        b'{"prompt": [1, 2, 3], "max_tokens": 8}',
    )
    (status, body), _ = limits.check(b'{"prompt": [1, 2, 3, 4, 5, 6]}', "/v1/completions")
    assert status == 400 and json.loads(body)["error"]["param"] == "prompt"
    (status, body), _ = limits.check(b'{"prompt": "x", "max_completion_tokens": true}', "/v1/completions")
    assert json.loads(body)["error"]["message"] == "max_completion_tokens must be an integer; got True"
    problem, body = limits.check(b'{"prompt": [1, 2, 3], "n": 2}', "/v1/completions")  # max_tokens added: 8 // 2
    assert problem is None and json.loads(body) == {"prompt": [1, 2, 3], "n": 2, "max_tokens": 4}


def test_a_request_without_max_tokens_stays_within_the_limit(endpoint):
    url, model = endpoint
    code, answer = post(
        url, "/v1/completions", {"model": model, "prompt": "hi", "n": 2, "temperature": 1.0, "ignore_eos": True}
    )
    assert code == 200, answer
    assert answer["usage"]["completion_tokens"] == 64 and len(answer["choices"]) == 2  # 2 x (64 // 2)


def test_bench_load_against_the_endpoint(endpoint, tiny_target):
    from peagle_ray.bench.load import percentile, run

    assert percentile([1, 2, 3, 4], 0.5) == 2 and percentile([1, 2, 3, 4], 0.99) == 4
    url, _ = endpoint
    cfg = build_config({"target": {"path": str(tiny_target)}, "serving": {"api_token": TOKEN}})
    result = run(cfg, url, clients=4, requests_per_client=2, max_tokens=8)
    assert result["requests"] == 8 and result["errors"] == 0, result["error_examples"]
    assert 0 < result["p50_latency_s"] <= result["p99_latency_s"] and result["tokens_per_s"] > 0
    assert result["speculative_stats"]["drafts"] > 0


def asgi_call(app, path="/v1/completions") -> tuple[int, dict, bytes]:
    """(status, headers, body) of one HTTP request through an ASGI app."""
    import asyncio

    sent: list[dict] = []

    async def receive():
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": path, "headers": []}
    asyncio.run(app(scope, receive, send))
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], {k.decode(): v.decode() for k, v in start.get("headers", [])}, body


def test_a_dead_engine_answers_503_with_retry_after_never_an_opaque_500():
    from peagle_ray.serve.app import RETRY_AFTER_S, EngineGuard

    state = {"dead": None, "status": 200}

    async def vllm_app(scope, receive, send):  # vLLM's app: a 500 once its engine died under the request
        await send({"type": "http.response.start", "status": state["status"], "headers": []})
        await send({"type": "http.response.body", "body": b'{"error": "EngineDeadError"}'})

    guard = EngineGuard(vllm_app, lambda: state["dead"])
    assert asgi_call(guard)[::2] == (200, b'{"error": "EngineDeadError"}')  # alive: untouched
    state["status"] = 500
    assert asgi_call(guard)[0] == 500  # a 500 of a live engine is vLLM's to give
    state["dead"] = "the engine died"
    for path in ("/v1/completions", "/health"):  # refused before vLLM sees it
        status, headers, body = asgi_call(guard, path)
        assert status == 503 and headers["retry-after"] == str(RETRY_AFTER_S)
        assert json.loads(body)["error"] == {
            "message": "the engine died",
            "type": "ServiceUnavailableError",
            "param": None,
            "code": 503,
        }

    dying = {"calls": 0}

    def dies_during_the_request():
        dying["calls"] += 1
        return None if dying["calls"] == 1 else "died mid-request"

    status, headers, body = asgi_call(EngineGuard(vllm_app, dies_during_the_request))
    assert status == 503 and json.loads(body)["error"]["message"] == "died mid-request"  # vLLM's body dropped


def test_the_curl_line_names_the_served_model():
    from peagle_ray.serve.app import endpoint_banner

    banner = endpoint_banner("http://127.0.0.1:8000", build_config({}), "SmolLM2-135M-Instruct")
    [line] = [x for x in banner.splitlines() if x.startswith("try:")]
    body = json.loads(line.split(" -d '")[1].rstrip("'"))
    assert body["model"] == "SmolLM2-135M-Instruct" and "MODEL" not in banner
