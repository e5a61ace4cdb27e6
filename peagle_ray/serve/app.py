"""The drafting-enabled REST endpoint: vLLM's OpenAI server inside a Ray Serve deployment.

One replica builds vLLM's own FastAPI app (every OpenAI route vLLM has: /v1/models, /v1/completions,
/v1/chat/completions with streaming, /health, /metrics, bearer-token auth on /v1 when a token is set) around
an engine that decodes with what serve/decoder.py chose: the target alone, the exported drafter (P-EAGLE:
parallel_drafting), vLLM's suffix decoding, or both (the hybrid, peagle_ray/hybrid.py). peagle-ray adds:

  * request limits checked before vLLM sees the request (serve/limits.py): HTTP 400 naming the field, the
    limit and the value for a non-object body, n / best_of, logprobs, too many prompts, a prompt over
    serving.max_prompt_tokens, generated tokens (prompts x n x max_tokens) over serving.max_tokens_limit,
    or an unknown chat role (vLLM's own validation answers every other malformed request with a 4xx);
  * GET /v1/speculative_stats: the decoder served and why, drafts, accepted tokens, acceptance per position
    and AL as JSON (the hybrid's also per source: "by_source"), and the same as Prometheus gauges
    (peagle_acceptance_length, peagle_acceptance_rate{position}, the hybrid's peagle_source_*) on /metrics;
  * with serving.record_dir, a record of every finished request for adaptation (serve/record.py), written
    off the request path.

    url = start_endpoint(cfg, target_dir, read_drafter(drafter_dir))     # serve.run; blocks until ready
    stop_endpoint()
"""

from __future__ import annotations

import hashlib
import json
import logging
import socket
import sys
import types
from dataclasses import dataclass
from pathlib import Path

from ray import serve

from peagle_ray import __version__
from peagle_ray.cluster import ensure_serve_http
from peagle_ray.config import ConfigError, PeagleConfig
from peagle_ray.engine import cli_args, engine_args, target_engine_env, use_local_cores
from peagle_ray.export.speculators import DrafterInfo, read_drafter
from peagle_ray.layout import drafter_dir
from peagle_ray.serve.decoder import ServedDecoder, served_decoder
from peagle_ray.serve.limits import Limits, admit
from peagle_ray.serve.record import CURRENT_REQUEST
from peagle_ray.serve.registry import ServedExport

log = logging.getLogger("ray.serve")  # a replica's log lines go to Serve's replica log file
APP_NAME = "peagle-openai"
LIMITED_ROUTES = ("/v1/completions", "/v1/chat/completions")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def served_model(target_dir: Path) -> str:
    """The model id the endpoint answers to (/v1/models): the target directory's name."""
    return Path(target_dir).name


def vllm_args(cfg: PeagleConfig, target_dir: Path, served: ServedDecoder, served_name: str | None = None) -> list[str]:
    """vLLM OpenAI-server command-line arguments for the target and the decoder served: engine.engine_args as
    flags (the hybrid's additional_config is added in the replica, which knows where its counts go)."""
    from peagle_ray.hybrid import ENGINE_ARGS as HYBRID_ENGINE_ARGS

    spec = served.speculative_config(cfg.serving.draft_max_batch_size)
    extra = HYBRID_ENGINE_ARGS if served.decoder == "hybrid" else {}
    args = cli_args({**engine_args(cfg, target_dir, cfg.serving.num_gpus > 0, spec), **extra})
    args += ["--served-model-name", served_name or served_model(target_dir)]
    if cfg.serving.api_token:
        args += ["--api-key", cfg.serving.api_token]
    return args


RETRY_AFTER_S = 15  # what a 503 tells clients to wait: Serve's health check (every 5 s, 3 failures) then a new replica


class EngineGuard:
    """Pure ASGI middleware: while the replica's engine is dead (`dead()` says why), every HTTP request gets 503
    with Retry-After, naming the cause, instead of vLLM's opaque 500s; a response vLLM starts with a 5xx
    because the engine died under it becomes the same 503. Serve's health check (OpenAIEndpoint.check_health)
    meanwhile replaces the replica. A stream that already answered 200 ends with vLLM's error chunk."""

    def __init__(self, app, dead):
        self.app, self.dead = app, dead

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if (reason := self.dead()) is not None:
            return await unavailable(send, reason)
        replaced = False

        async def guarded(message):
            nonlocal replaced
            if message["type"] == "http.response.start" and message["status"] >= 500:
                reason = self.dead()
                if reason is not None:
                    replaced = True
                    return await unavailable(send, reason)
            if not replaced:  # vLLM's own body of a replaced response is dropped
                await send(message)

        return await self.app(scope, receive, guarded)


async def unavailable(send, reason: str) -> None:
    """HTTP 503 with Retry-After and an OpenAI-shaped error body saying `reason`."""
    error = {"message": reason, "type": "ServiceUnavailableError", "param": None, "code": 503}
    headers = [(b"content-type", b"application/json"), (b"retry-after", str(RETRY_AFTER_S).encode())]
    await send({"type": "http.response.start", "status": 503, "headers": headers})
    await send({"type": "http.response.body", "body": json.dumps({"error": error}).encode()})


class RequestLimits:
    """Pure ASGI middleware: admits the body of POST /v1/completions and /v1/chat/completions (serve/limits.py)."""

    def __init__(self, app, tokenizer, limits: Limits, recording: bool = False):
        self.app, self.tokenizer, self.limits, self.recording = app, tokenizer, limits, recording

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in LIMITED_ROUTES:
            return await self.app(scope, receive, send)
        chunks, more = [], True
        while more:
            message = await receive()
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        problem, body = self.check(b"".join(chunks), scope["path"])
        if problem is not None:
            status, payload = problem
            await send(
                {"type": "http.response.start", "status": status, "headers": [(b"content-type", b"application/json")]}
            )
            return await send({"type": "http.response.body", "body": payload})
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # then pass disconnects through

        if self.recording:  # the engine wrapper (serve/record.py) reads it inside this request's task
            route = "chat" if scope["path"].endswith("chat/completions") else "completion"
            CURRENT_REQUEST.set((route, json.loads(body)))
        return await self.app(scope, replay, send)

    def check(self, body: bytes, path: str) -> tuple[tuple[int, bytes] | None, bytes]:
        """(None, body to forward) or ((400, OpenAI error body), body)."""
        return admit(body, path.endswith("chat/completions"), self.limits, self.prompt_lengths)

    def prompt_lengths(self, value, chat: bool) -> list[int]:
        """Token counts of the prompt(s); [] when the value is malformed (vLLM's validation reports it)."""
        try:
            if chat:
                text = self.tokenizer.apply_chat_template(value, tokenize=False, add_generation_prompt=True)
                return [len(self.tokenizer(text, add_special_tokens=False)["input_ids"])]
            if isinstance(value, str):
                return [len(self.tokenizer(value)["input_ids"])]
            if isinstance(value, list) and value and all(isinstance(v, int) for v in value):
                return [len(value)]
            if isinstance(value, list):
                return [len(v) if isinstance(v, list) else len(self.tokenizer(v)["input_ids"]) for v in value]
        except Exception:  # noqa: BLE001 - malformed prompts are vLLM's to reject with its own message
            return []
        return []


def request_limits(cfg: PeagleConfig) -> Limits:
    s = cfg.serving
    return Limits(
        s.max_prompt_tokens,
        s.max_tokens_limit,
        s.max_n,
        s.max_logprobs,
        s.max_prompts_per_request,
        cfg.target.max_model_len,
    )


@dataclass(frozen=True)
class Recording:
    """serving.record_dir and its size limits, in bytes."""

    directory: str
    file_bytes: int
    max_bytes: int


@dataclass(frozen=True)
class EndpointSpec:
    """Plain data the replica builds its app from."""

    vllm_args: list[str]
    target_dir: str
    limits: Limits
    served: ServedDecoder
    recording: Recording | None = None


@serve.deployment(name="OpenAIEndpoint", max_ongoing_requests=256, health_check_period_s=5)
@serve.ingress()
class OpenAIEndpoint:
    def __init__(self, spec: EndpointSpec):
        self.spec = spec
        self.engine = None
        self._death_logged = False

    def engine_dead(self) -> str | None:
        """Why this replica cannot serve (its vLLM engine died), or None while it can."""
        if self.engine is None or not self.engine.errored:
            return None
        return (
            "the endpoint's vLLM engine died and Ray Serve is replacing it; retry in a few seconds "
            "(/health answers 200 again once it serves)"
        )

    async def check_health(self):
        """Serve's health check (every health_check_period_s): fails while the engine is dead, so that Serve
        replaces this replica (after 3 failures in a row); said once in the replica's log."""
        reason = self.engine_dead()
        if reason is None:
            return
        if not self._death_logged:
            self._death_logged = True
            log.error("endpoint: the vLLM engine died; failing Serve's health check so that it replaces this replica")
        raise RuntimeError(reason)

    async def __serve_build_asgi_app__(self):
        """Called by Serve in the replica after __init__: start the engine and build vLLM's app on it."""
        from fastapi.responses import JSONResponse
        from transformers import AutoTokenizer
        from vllm.entrypoints.launchers.api_server.app_state import init_app_state
        from vllm.entrypoints.launchers.api_server.entry import build_async_engine_client
        from vllm.entrypoints.launchers.app import build_app
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
        from vllm.utils.argparse_utils import FlexibleArgumentParser
        from vllm.v1.metrics.prometheus import get_prometheus_registry

        from peagle_ray.hybrid import read_stats
        from peagle_ray.serve.stats import SpecStatsCollector
        from peagle_ray.spec_counters import current_stats

        use_local_cores()
        extra = self.spec.served.additional_config(self.stats_file())
        flags = [*self.spec.vllm_args, *(["--additional-config", json.dumps(extra)] if extra else [])]
        args = make_arg_parser(FlexibleArgumentParser()).parse_args(flags)
        self._engine_context = build_async_engine_client(args)
        self.engine = await self._engine_context.__aenter__()
        tasks = await self.engine.get_supported_tasks()
        app = build_app(args, tasks, self.engine.model_config)
        names = args.served_model_name
        await init_app_state(self._recorded(names[0] if isinstance(names, list) else names), app.state, args, tasks)
        app.router.lifespan_context = _no_lifespan  # vLLM's only starts a periodic stats print
        # vLLM's engine-error handler asks the uvicorn server to exit (terminate_if_errored, app.state.server);
        # here Serve owns the server, and the health check replaces a replica whose engine died
        app.state.server = types.SimpleNamespace(should_exit=False)

        served = self.spec.served.to_json()
        by_source = lambda: read_stats(self._stats_file)  # noqa: E731 - the hybrid's engine core writes it

        @app.get("/v1/speculative_stats")
        async def speculative_stats():
            sources = {name: counts.to_json() for name, counts in by_source().items()}
            return JSONResponse({**served, **current_stats().to_json(), **({"by_source": sources} if sources else {})})

        try:
            get_prometheus_registry().register(SpecStatsCollector(by_source))
        except ValueError:
            pass  # already registered in this process
        tokenizer = AutoTokenizer.from_pretrained(self.spec.target_dir)
        log.info("endpoint: replica ready, %s", self.spec.served.line())
        # wrapped rather than app.add_middleware: vLLM's app has already built its middleware stack
        limited = RequestLimits(app, tokenizer, self.spec.limits, recording=self.recorder is not None)
        return EngineGuard(limited, self.engine_dead)

    def stats_file(self) -> str | None:
        """Where the hybrid's engine core writes its counts per source (None for any other decoder)."""
        import tempfile

        self._stats_file = None
        if self.spec.served.decoder == "hybrid":
            self._stats_file = str(Path(tempfile.mkdtemp(prefix="peagle-hybrid-")) / "by_source.json")
        return self._stats_file

    def _recorded(self, model: str):
        """The engine client the app uses: the engine itself, or seen through a traffic recorder."""
        from peagle_ray.serve.record import RecordingEngine, TrafficRecorder

        self.recorder = None
        rec = self.spec.recording
        if rec is None:
            return self.engine
        self.recorder = TrafficRecorder(rec.directory, rec.file_bytes, rec.max_bytes)
        return RecordingEngine(self.engine, self.recorder, model, self.spec.served.to_json())

    def __del__(self):
        if getattr(self, "recorder", None) is not None:
            self.recorder.close()
        if getattr(self, "engine", None) is not None:
            self.engine.shutdown()


class _no_lifespan:
    def __init__(self, app):
        pass

    async def __aenter__(self):
        return None

    async def __aexit__(self, *exc):
        return False


def endpoint_app(
    cfg: PeagleConfig,
    target_dir: Path,
    drafter: DrafterInfo | None,
    k: int | None = None,
    start_attempts: int | None = None,
):
    """The Serve application (bind only; `serve run` / `serve.run` deploys it); drafter from read_drafter.
    What it decodes with is serving_decoder's choice. `start_attempts`: how many times Serve starts a replica
    that fails before the deployment fails (None: Serve's default, 3 for one replica)."""
    served = serving_decoder(cfg, drafter, k)
    spec = EndpointSpec(
        vllm_args(cfg, target_dir, served), str(target_dir), request_limits(cfg), served, recording(cfg)
    )
    env = target_engine_env(
        cfg.target, {}, cfg.serving.num_gpus > 0
    )  # only the engine settings, not this process's environment
    options = {"num_cpus": 0, "num_gpus": cfg.serving.num_gpus, "runtime_env": {"env_vars": env}}
    retries = {} if start_attempts is None else {"max_constructor_retry_count": start_attempts}
    # max_surge_percent 100: on a new drafter the old replica serves until its replacement is ready (swap)
    return OpenAIEndpoint.options(  # type: ignore[attr-defined]  # @serve.deployment made it a Deployment
        ray_actor_options=options, max_surge_percent=100, **retries, **deployment_version(spec, options)
    ).bind(spec)


def deployment_version(spec: EndpointSpec, actor_options: dict) -> dict:
    """Deployment options naming the version of what the replicas run: the same spec and actor options (and
    peagle-ray release) give the same version, so deploying what already runs restarts nothing (swap_drafter's
    way back to the drafter that serves). serve.run otherwise draws a random version each time, and every
    deploy replaced the replicas (one replica start: ~1.5 min on a busy CPU box). Serve keeps `version` out of
    its public options since Ray 2.x ("Serve manages deployment versions internally"); `_internal` is the
    door its own declarative path uses. Returns {} where this Ray has no such door."""
    import inspect

    parameters = inspect.signature(serve.Deployment.options).parameters
    if "version" not in parameters or "_internal" not in parameters:
        return {}
    key = json.dumps([repr(spec), repr(sorted(actor_options.items())), __version__])
    return {"version": hashlib.sha256(key.encode()).hexdigest()[:16], "_internal": True}


def serving_decoder(cfg: PeagleConfig, drafter: DrafterInfo | None, k: int | None = None) -> ServedDecoder:
    """serve/decoder.served_decoder from the config (serving.decoder, serving.num_speculative_tokens unless `k`,
    serving.hybrid_threshold, serving.drafter_version); suffix decoding without its suffix tree is refused
    here, naming the command that builds it."""
    from peagle_ray.hybrid import SUFFIX_MISSING, suffix_available

    s = cfg.serving
    served = served_decoder(drafter, k or s.num_speculative_tokens, s.decoder, s.hybrid_threshold, s.drafter_version)
    if served.uses_suffix and not suffix_available():
        raise ConfigError(SUFFIX_MISSING.format(python=sys.executable))
    return served


def recording(cfg: PeagleConfig) -> Recording | None:
    s = cfg.serving
    if s.record_dir is None:
        return None
    mb = 1 << 20
    return Recording(str(Path(s.record_dir).resolve()), int(s.record_file_mb * mb), int(s.record_max_mb * mb))


def start_endpoint(cfg: PeagleConfig, target_dir: Path, drafter: DrafterInfo | None, k: int | None = None) -> str:
    """Deploy on the running Ray cluster; returns the base URL once the replica is ready."""
    ensure_serve_http(cfg.serving.host, cfg.serving.port)
    serve.run(endpoint_app(cfg, target_dir, drafter, k), name=APP_NAME, route_prefix="/")
    return f"http://{cfg.serving.host}:{cfg.serving.port}"


def serve_forever(cfg: PeagleConfig, chosen: ServedExport | None, k: int | None = None, detach: bool = False) -> None:
    """`peagle-ray serve`: the target, drafting with an exported drafter, as an OpenAI-compatible REST endpoint
    on Ray Serve.

    `chosen` (serve/registry.chosen_drafter): --drafter DIR; without it the registry's version holding
    adapt.alias and its recorded verdict, else the training run's export; None (--no-drafter) serves the
    target alone. Joins the cluster in RAY_ADDRESS or starts a local one; binds to serving.host:serving.port
    (loopback by default); bearer-token auth when serving.api_token is set. A bad target or drafter fails
    before Ray starts. Ctrl-C / SIGTERM stop the endpoint (KeyboardInterrupt); with detach, it returns once
    deployed and the endpoint keeps running on the cluster."""
    import time

    from peagle_ray.cluster import ensure_ray
    from peagle_ray.config import with_values
    from peagle_ray.target import resolve_target_path

    target = resolve_target_path(cfg)
    if chosen is not None and chosen.label and not cfg.serving.drafter_version:
        cfg = with_values(cfg, {"serving.drafter_version": chosen.label})
    drafter = chosen.drafter if chosen is not None else None
    served = serving_decoder(cfg, drafter, k)  # refused here, before Ray starts
    ensure_ray()
    url = start_endpoint(cfg, target, drafter, k)
    if chosen is not None:
        print(f"drafter:  {chosen.directory}" + (f" ({chosen.label})" if chosen.label else "") + f": {chosen.why}")
    print(endpoint_banner(url, cfg, served_model(target)), served.line(), sep="\n", flush=True)
    if detach:
        return
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        print("stopping the endpoint", file=sys.stderr)
        raise  # the CLI stops Ray and exits 128 + the signal
    finally:
        stop_endpoint()
        serve.shutdown()


def endpoint_running() -> bool:
    """Whether this Ray cluster runs the endpoint's application (Ray must be initialised; serve.status() is
    empty, and starts nothing, where Serve is not running)."""
    return APP_NAME in serve.status().applications


def swap_drafter(cfg: PeagleConfig, drafter_dir: Path, version: str | None, previous: tuple[Path, str | None]) -> None:
    """Roll the running endpoint onto another drafter without dropping a request: Serve starts a replica
    with the new drafter while the old one serves (max_surge_percent), routes to it once it is ready, and
    drains the old one. A new replica that fails to start (once: no retries) raises RuntimeError after the
    application is put back on `previous` (drafter dir, version), whose replicas never stopped serving."""
    from peagle_ray.config import with_values
    from peagle_ray.target import resolve_target_path

    target = resolve_target_path(cfg)

    def deploy(directory: Path, label: str | None, start_attempts: int | None = None) -> None:
        versioned = with_values(cfg, {"serving.drafter_version": label})
        app = endpoint_app(versioned, target, read_drafter(directory), start_attempts=start_attempts)
        serve.run(app, name=APP_NAME, route_prefix="/")

    try:
        # one start attempt: the old replicas serve meanwhile, and a drafter that cannot load fails the swap
        # after one replica start instead of Serve's three (~2 min each on a busy CPU box)
        deploy(drafter_dir, version, start_attempts=1)
    except Exception as err:  # noqa: BLE001 - Serve raises its own types for a failed deployment
        deploy(*previous)  # the old replicas have this version (deployment_version): Serve keeps them
        raise RuntimeError(
            f"swapping in drafter {drafter_dir} ({version}) failed: {err}; {previous[0]} keeps serving"
        ) from err


def stop_endpoint() -> None:
    """Delete the endpoint's application; nothing to do where Serve never started (a run that failed early)."""
    from ray.serve.exceptions import RayServeException

    try:
        serve.delete(APP_NAME)
    except RayServeException:
        pass


def app_builder(args: dict):
    """`serve run peagle_ray.serve.app:app_builder config=FILE [drafter=DIR] [k=K]` and deploy/serve.yaml.

    args: config (YAML path; default built-in defaults), drafter (export dir; default the config's training
    run export), k (speculative tokens; default serving.num_speculative_tokens or the drafter's K),
    set (list of SECTION.FIELD=VALUE overrides).
    """
    from peagle_ray.config import load_config
    from peagle_ray.target import resolve_target_path

    cfg = load_config(args.get("config"), list(args.get("set") or []))
    drafter = args.get("drafter") or drafter_dir(cfg)
    return endpoint_app(
        cfg,
        resolve_target_path(cfg),
        read_drafter(Path(drafter)) if drafter != "none" else None,
        int(args["k"]) if args.get("k") else None,
    )


def endpoint_banner(url: str, cfg: PeagleConfig, model: str) -> str:
    """What to tell a user once the endpoint is up: the URL, a curl to try on `model`, where the statistics are."""
    auth = f' -H "Authorization: Bearer {cfg.serving.api_token}"' if cfg.serving.api_token else ""
    messages = [{"role": "user", "content": "Write a haiku about CPUs."}]
    body = json.dumps({"model": model, "messages": messages, "max_tokens": 64, "temperature": 0})
    return "\n".join(
        [
            f"endpoint: {url}/v1 (OpenAI-compatible; models: curl{auth} {url}/v1/models)",
            f"try:      curl{auth} {url}/v1/chat/completions -H 'Content-Type: application/json' -d '{body}'",
            f"stats:    {url}/v1/speculative_stats (JSON), {url}/metrics (Prometheus), {url}/health",
        ]
    )
