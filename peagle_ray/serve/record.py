"""Traffic recording at the endpoint (opt-in, `serving.record_dir`): what the target saw and said, for adaptation.

One JSON line per finished request (chat, completion, streaming or not), e.g.

    {"schema": "peagle-traffic/1", "id": "chatcmpl-9f..", "time": 1764600000.1, "route": "chat",
     "conversation_id": null, "messages": [{"role": "user", "content": "Hi"}], "prompt": null,
     "prompt_ids": [1, 9, 4], "output_ids": [[17, 2]], "finish_reasons": ["stop"],
     "sampling": {"temperature": 0.0, "top_p": 1.0, ...}, "model": "SmolLM2-135M-Instruct",
     "drafter": {"algorithm": "peagle", "path": "/..../export", "version": "peagle-drafter/3"}}

Stored: the request's `messages` (chat) or `prompt` (completions) as sent, the prompt's token ids as the
target saw them (chat template applied), the generated token ids of each of the n outputs, the sampling
parameters, the served model name and the drafter (algorithm, path, registered version when known), and
`metadata.conversation_id` of the body when the client sets one. Never stored: HTTP headers (so no bearer
token), client addresses, logprobs.

Off the request path: `submit` only puts the record on a bounded queue (a full queue drops the record and
counts it); one writer thread appends to `traffic-<start>-<pid>-<n>.jsonl` (mode 0600), rotates a file at
`record_file_mb` and deletes this process's oldest files beyond `record_max_mb` in all. A write that fails
(full disk, directory gone or unwritable) logs one warning and stops recording: requests keep being served.
"""

from __future__ import annotations

import contextvars
import json
import logging
import os
import queue
import threading
import time
from pathlib import Path
from typing import BinaryIO

from peagle_ray.data.traffic import SCHEMA

SAMPLING_FIELDS = (
    "n",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "max_tokens",
    "min_tokens",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "stop",
    "ignore_eos",
)

# The admitted request body (a dict) and its route ("chat" | "completion"), set by the endpoint's request
# middleware for the engine wrapper below, which runs inside the same request's task.
CURRENT_REQUEST: contextvars.ContextVar[tuple[str, dict] | None] = contextvars.ContextVar(
    "peagle_current_request", default=None
)

log = logging.getLogger("peagle_ray.record")


class TrafficRecorder:
    """Appends records to rotated JSONL files from a background thread; never raises into the caller."""

    def __init__(self, directory: str | Path, file_bytes: int, max_bytes: int, queue_size: int = 1024):
        self.directory = Path(directory)
        self.file_bytes, self.max_bytes = file_bytes, max_bytes
        self.queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self.recorded = self.dropped = 0
        self.stopped_reason: str | None = None
        self._prefix = f"traffic-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
        self._files: list[Path] = []  # this recorder's files, oldest first
        self._opened = 0
        self._handle: BinaryIO | None = None
        self._size = 0
        self._thread = threading.Thread(target=self._run, name="traffic-recorder", daemon=True)
        self._thread.start()

    def submit(self, record: dict) -> None:
        """Queue one record (non-blocking); dropped and counted when the writer is behind or stopped."""
        if self.stopped_reason is not None:
            return
        try:
            self.queue.put_nowait(record)
        except queue.Full:
            self.dropped += 1

    def close(self, timeout_s: float = 10.0) -> None:
        """Write what is queued, then stop the writer."""
        self.queue.put(None)
        self._thread.join(timeout_s)

    def flush(self, timeout_s: float = 10.0) -> None:
        """Wait until every queued record is written (tests, shutdown)."""
        deadline = time.monotonic() + timeout_s
        while self.queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)

    # ---- the writer thread ------------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            record = self.queue.get()
            try:
                if record is None:
                    self._close_file()
                    return
                if self.stopped_reason is None:
                    self._write(json.dumps(record, separators=(",", ":")).encode() + b"\n")
            except OSError as err:
                self._stop(f"{type(err).__name__}: {err}")
            except (TypeError, ValueError) as err:  # a record that is not JSON: skip it, keep recording
                log.warning("traffic recording: skipped a record that is not JSON (%s)", err)
            finally:
                self.queue.task_done()

    def _write(self, line: bytes) -> None:
        handle = self._handle
        if handle is None or self._size + len(line) > self.file_bytes:
            handle = self._rotate()
        handle.write(line)
        handle.flush()
        self._size += len(line)
        self.recorded += 1

    def _rotate(self) -> BinaryIO:
        """A new file to write to (the oldest deleted beyond serving.record_max_mb)."""
        self._close_file()
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        path = self.directory / f"{self._prefix}-{self._opened:05d}.jsonl"
        self._opened += 1
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        handle = self._handle = os.fdopen(fd, "ab")
        self._size = 0
        self._files.append(path)
        while len(self._files) > 1 and sum(_size(p) for p in self._files) + self.file_bytes > self.max_bytes:
            self._files.pop(0).unlink(missing_ok=True)
        return handle

    def _close_file(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None

    def _stop(self, reason: str) -> None:
        self.stopped_reason = reason
        self._close_file()
        log.warning(
            "traffic recording stopped: writing to serving.record_dir = %s failed (%s); the endpoint keeps "
            "serving without recording",
            self.directory,
            reason,
        )


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def sampling_dict(params) -> dict:
    """The SamplingParams fields a replay needs, as plain JSON values."""
    out = {}
    for name in SAMPLING_FIELDS:
        value = getattr(params, name, None)
        out[name] = list(value) if isinstance(value, (list, tuple)) else value
    return out


def traffic_record(
    request_id: str,
    request: tuple[str, dict] | None,
    prompt_ids: list[int],
    outputs: dict[int, list[int]],
    finish_reasons: dict[int, str | None],
    sampling: dict,
    model: str,
    drafter: dict | None,
) -> dict:
    """One line of the recording (schema above); `request` is (route, body) from CURRENT_REQUEST."""
    route, body = request if request is not None else ("engine", {})
    metadata = body.get("metadata")
    conversation = metadata.get("conversation_id") if isinstance(metadata, dict) else None
    indices = sorted(outputs)
    return {
        "schema": SCHEMA,
        "id": request_id,
        "time": time.time(),
        "route": route,
        "conversation_id": conversation if isinstance(conversation, str) else None,
        "messages": body.get("messages") if route == "chat" else None,
        "prompt": body.get("prompt") if route == "completion" else None,
        "prompt_ids": list(prompt_ids),
        "output_ids": [outputs[i] for i in indices],
        "finish_reasons": [finish_reasons.get(i) for i in indices],
        "sampling": sampling,
        "model": model,
        "drafter": drafter,
    }


class RecordingEngine:
    """The endpoint's engine client seen through a recorder: `generate` yields vLLM's outputs unchanged and,
    once a request finishes, hands its record to the recorder; everything else is the engine's own.

    Outputs arrive whole (FINAL) or as deltas (streaming: DELTA), one entry per completion index; both are
    accumulated by index. A request that ends early (client gone, error) is not recorded."""

    def __init__(self, engine, recorder: TrafficRecorder, model: str, drafter: dict | None):
        self._engine, self._recorder, self._model, self._drafter = engine, recorder, model, drafter

    def __getattr__(self, name):
        return getattr(self._engine, name)

    async def generate(self, prompt, sampling_params, request_id, *args, **kwargs):
        delta = getattr(getattr(sampling_params, "output_kind", None), "name", None) == "DELTA"  # streaming
        request = CURRENT_REQUEST.get()
        outputs: dict[int, list[int]] = {}
        reasons: dict[int, str | None] = {}
        prompt_ids: list[int] = []
        finished = False
        async for out in self._engine.generate(prompt, sampling_params, request_id, *args, **kwargs):
            prompt_ids = out.prompt_token_ids or prompt_ids
            for completion in out.outputs:
                ids = list(completion.token_ids)
                outputs[completion.index] = outputs.get(completion.index, []) + ids if delta else ids
                reasons[completion.index] = completion.finish_reason
            finished = out.finished
            yield out
        if finished:
            try:
                record = traffic_record(
                    request_id,
                    request,
                    prompt_ids,
                    outputs,
                    reasons,
                    sampling_dict(sampling_params),
                    self._model,
                    self._drafter,
                )
                self._recorder.submit(record)
            except Exception as err:  # noqa: BLE001 - recording must never fail a request
                log.warning("traffic recording: request %s not recorded (%s)", request_id, err)
