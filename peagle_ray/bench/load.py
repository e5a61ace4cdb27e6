"""`peagle-ray bench load`: N concurrent OpenAI clients against the REST endpoint.

Each client sends `requests_per_client` chat completions one after another (held-out prompts, greedy,
max_tokens each); reported: requests, errors (with the first few messages), p50/p99 latency, completion
tokens/s over the whole run. Against `--url` (a running endpoint), or an endpoint this command starts from
the config and stops afterwards.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

from peagle_ray.config import ConfigError, PeagleConfig
from peagle_ray.options import Opt


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile: e.g. q=0.5 of [1, 2, 3, 4] -> 2, q=0.99 -> 4."""
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, int(-(-q * len(ordered) // 1)) - 1))]


async def _load(
    url: str, model: str, token: str | None, prompts: list[str], clients: int, requests_per_client: int, max_tokens: int
) -> dict:
    import openai

    api = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=token or "none", max_retries=0, timeout=600)
    latencies, tokens, errors = [], 0, []

    async def client(index: int) -> None:
        nonlocal tokens
        for r in range(requests_per_client):
            prompt = prompts[(index * requests_per_client + r) % len(prompts)]
            start = time.perf_counter()
            try:
                result = await api.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0
                )
            except openai.OpenAIError as err:
                errors.append(f"{type(err).__name__}: {err}"[:200])
                continue
            latencies.append(time.perf_counter() - start)
            tokens += result.usage.completion_tokens if result.usage else 0

    started = time.perf_counter()
    await asyncio.gather(*(client(i) for i in range(clients)))
    wall = time.perf_counter() - started
    await api.close()
    return {
        "clients": clients,
        "requests": clients * requests_per_client,
        "errors": len(errors),
        "error_examples": errors[:3],
        "p50_latency_s": round(percentile(latencies, 0.5), 3) if latencies else None,
        "p99_latency_s": round(percentile(latencies, 0.99), 3) if latencies else None,
        "mean_latency_s": round(statistics.mean(latencies), 3) if latencies else None,
        "completion_tokens": tokens,
        "tokens_per_s": round(tokens / wall, 2),
        "wall_s": round(wall, 1),
    }


def load_prompts() -> list[str]:
    """User turns of the built-in suite's validation prompts."""
    from peagle_ray.data.suite import builtin_conversations

    return [
        next(m["content"] for m in c.messages if m["role"] == "user")
        for c in builtin_conversations()
        if c.split == "validation"
    ]


def run(
    cfg: PeagleConfig,
    url: Annotated[str | None, Opt("A running endpoint (default: start one from the config, stop it after).")] = None,
    clients: Annotated[int, Opt("Concurrent OpenAI clients.")] = 32,
    requests_per_client: Annotated[int, Opt("Requests each client sends.")] = 2,
    max_tokens: Annotated[int, Opt("Tokens per request.")] = 64,
    drafter_dir: Annotated[Path | None, Opt("Drafter for an endpoint this command starts.", flag="--drafter")] = None,
    decoders: Annotated[
        list[str] | None,
        Opt(
            "Serve each of these decoders in turn (target drafter suffix hybrid) and load each at every "
            "--client-counts; default: the config's serving.decoder, at --clients.",
            flag="--decoders",
        ),
    ] = None,  # fmt: skip
    client_counts: Annotated[
        list[int] | None, Opt("Client counts for --decoders (default: 1 8 32).", flag="--client-counts")
    ] = None,
) -> dict:
    """One endpoint under `clients` concurrent clients; with `decoders`, a matrix: each decoder served in turn
    (one endpoint each, configs' other serving settings kept) under each of `client_counts`: {"rows": [...]}."""
    if decoders:
        if url is not None:
            raise ConfigError("bench load --decoders starts its own endpoints; --url serves one decoder")
        from peagle_ray.config import with_values

        rows = []
        for decoder in decoders:
            served = with_values(cfg, {"serving.decoder": decoder})
            with endpoint(served, drafter_dir) as started:
                for n in client_counts or [1, 8, 32]:
                    row = load_once(served, started, n, requests_per_client, max_tokens)
                    rows.append({"decoder": decoder, **row})
                    print(
                        f"[bench load] {decoder} at {n} clients: {row['errors']} errors, p50 {row['p50_latency_s']} "
                        f"s, p99 {row['p99_latency_s']} s, {row['tokens_per_s']} tok/s",
                        flush=True,
                    )
        return {"max_tokens": max_tokens, "requests_per_client": requests_per_client, "rows": rows}
    if url is not None:
        return load_once(cfg, url, clients, requests_per_client, max_tokens)
    with endpoint(cfg, drafter_dir) as started:
        return load_once(cfg, started, clients, requests_per_client, max_tokens)


@contextmanager
def endpoint(cfg: PeagleConfig, drafter_dir: Path | None):
    """The endpoint started from the config with `drafter_dir` (default: the training run's export, if any);
    yields its URL, stops it afterwards."""
    from ray import serve

    from peagle_ray.cluster import ensure_ray
    from peagle_ray.export.speculators import read_drafter
    from peagle_ray.layout import drafter_dir as default_drafter
    from peagle_ray.serve.app import start_endpoint, stop_endpoint
    from peagle_ray.target import resolve_target_path

    ensure_ray()
    drafter = Path(drafter_dir) if drafter_dir else default_drafter(cfg)
    info = read_drafter(drafter) if (drafter / "config.json").is_file() else None
    try:
        yield start_endpoint(cfg, resolve_target_path(cfg), info)
    finally:
        stop_endpoint()
        serve.shutdown()


def load_once(cfg: PeagleConfig, url: str, clients: int, requests_per_client: int, max_tokens: int) -> dict:
    """`clients` concurrent clients against the endpoint at `url`, and its /v1/speculative_stats after."""
    from peagle_ray.serve.app import served_model
    from peagle_ray.target import resolve_target_path

    model = served_model(resolve_target_path(cfg))
    result = asyncio.run(
        _load(url, model, cfg.serving.api_token, load_prompts(), clients, requests_per_client, max_tokens)
    )
    request = urllib.request.Request(
        f"{url}/v1/speculative_stats",
        headers=({"Authorization": f"Bearer {cfg.serving.api_token}"} if cfg.serving.api_token else {}),
    )
    with urllib.request.urlopen(request, timeout=30) as resp:
        result["speculative_stats"] = json.loads(resp.read())
    return {"endpoint": url, "max_tokens": max_tokens, **result}
