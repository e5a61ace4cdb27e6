"""The Ray Data side of capture: an actor that sends a batch of conversations to the Serve-hosted target in one
request and turns the answer into rows. Numpy and Ray only (no torch): the actor starts in about a second.

Wire format (TargetServer.capture_batch -> CaptureStage), per sequence either
    {"hidden_states": (T, n_layers, H) in the target's dtype, "token_ids": (T,), "non_finite": int, "dtype": str}
or {"error": str}. A bfloat16 target's states travel as their int16 bit pattern (numpy has no bfloat16) with
dtype "bfloat16"; `as_tensor` in pipeline.py turns them back. Nothing is upcast on the way: float32 is made
where training needs it (train/worker.to_sequence).

Rows (one per conversation): sample_id, split, input_ids (T,) int64, loss_mask (T,) int8, aux_hidden (T, A) and
last_hidden (T, H) in the wire dtype, hidden_dtype, error ("" or a CAPTURE_ERRORS reason), and the batch's
timings shared equally among its rows (capture_s: the request's round trip seen by the actor; engine_s: the
engine prefilling the batch; read_s: the replica reading the connector's files; wire_bytes: hidden-state bytes
received).
"""

from __future__ import annotations

import time

import numpy as np

APP_NAME = "peagle-target"  # the Serve application of the capture target (target_server.py)
CAPTURE_ERRORS = ("token_mismatch", "non_finite", "bad_shape", "capture_failed")
TIMING_COLUMNS = ("capture_s", "engine_s", "read_s", "wire_bytes")
WIRE_VIEWS = {"bfloat16": "int16"}  # target dtypes numpy lacks, carried as their bit pattern


class BadCapture(Exception):
    def __init__(self, reason: str, detail: str = ""):
        assert reason in CAPTURE_ERRORS, reason
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


def validate_capture(
    input_ids: np.ndarray, captured: dict, num_layers: int, hidden_size: int, dtype: str | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """(aux (T, A), last (T, H)) in the wire dtype from one sequence's wire dict, or BadCapture naming what is
    wrong (`dtype`: the one expected, None: any)."""
    if "error" in captured:
        raise BadCapture("capture_failed", str(captured["error"])[:200])
    hidden, token_ids = captured["hidden_states"], captured["token_ids"]
    t = len(input_ids)
    if tuple(hidden.shape) != (t, num_layers, hidden_size):
        raise BadCapture("bad_shape", f"expected {(t, num_layers, hidden_size)}; got {tuple(hidden.shape)}")
    if dtype is not None and captured["dtype"] != dtype:
        raise BadCapture("bad_shape", f"expected dtype {dtype}; got {captured['dtype']}")
    if not np.array_equal(np.asarray(token_ids, dtype=np.int64), np.asarray(input_ids, dtype=np.int64)):
        raise BadCapture("token_mismatch", "captured token ids differ from the request")
    if captured["non_finite"]:
        raise BadCapture("non_finite", f"{captured['non_finite']} NaN/Inf values")
    return hidden[:, :-1].reshape(t, -1), hidden[:, -1]


class CaptureStage:
    """Ray Data actor: captures a batch of conversations in one request to the Serve deployment."""

    def __init__(self, num_layers: int, hidden_size: int, app_name: str = APP_NAME):
        from ray import serve

        self.handle = serve.get_app_handle(app_name)
        self.num_layers, self.hidden_size = num_layers, hidden_size
        self.dtype = self.handle.hidden_dtype.remote().result()  # every row's, error rows' empty arrays too
        self.wire_dtype = np.dtype(WIRE_VIEWS.get(self.dtype, self.dtype))

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, list]:
        n = len(batch["input_ids"])
        start = time.perf_counter()
        try:
            answer = self.handle.capture_batch.remote([ids.tolist() for ids in batch["input_ids"]]).result()
            items, timing = answer["items"], answer["timing"]
        except Exception as err:  # noqa: BLE001  a failed request is bad rows, not a dead run
            items, timing = [{"error": repr(err)}] * n, {"engine_s": 0.0, "read_s": 0.0}
        capture_s = time.perf_counter() - start
        out: dict[str, list] = {k: [] for k in ("sample_id", "split", "input_ids", "loss_mask", "aux_hidden")}
        out.update({k: [] for k in ("last_hidden", "hidden_dtype", "error", *TIMING_COLUMNS)})
        wire_bytes = sum(item["hidden_states"].nbytes for item in items if "hidden_states" in item)
        for i, (ids, captured) in enumerate(zip(batch["input_ids"], items, strict=True)):
            try:
                aux, last = validate_capture(ids, captured, self.num_layers, self.hidden_size, self.dtype)
                error = ""
            except BadCapture as err:
                aux = np.zeros((0, (self.num_layers - 1) * self.hidden_size), self.wire_dtype)
                last, error = np.zeros((0, self.hidden_size), self.wire_dtype), err.reason
            out["sample_id"].append(batch["sample_id"][i])
            out["split"].append(batch["split"][i])
            out["input_ids"].append(np.asarray(ids, dtype=np.int64))
            out["loss_mask"].append(np.asarray(batch["loss_mask"][i], dtype=np.int8))
            out["aux_hidden"].append(aux)
            out["last_hidden"].append(last)
            out["hidden_dtype"].append(self.dtype)
            out["error"].append(error)
            out["capture_s"].append(capture_s / n)
            out["engine_s"].append(timing["engine_s"] / n)
            out["read_s"].append(timing["read_s"] / n)
            out["wire_bytes"].append(wire_bytes / n)
        return out
