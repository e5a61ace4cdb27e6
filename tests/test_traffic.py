"""Traffic recording (serve/record.py: the writer, the engine wrapper) and recorded traffic as a data source
(data/traffic.py: bad lines, the split by request, samples). The endpoint's own recording is in test_serve."""

import asyncio
import json
import logging
import os
import stat
from types import SimpleNamespace

import pytest

from peagle_ray.config import ConfigError, build_config
from peagle_ray.data.prepare import BadRows, prepare_samples
from peagle_ray.data.sources import check_sources, read_conversations
from peagle_ray.data.traffic import (
    SCHEMA,
    traffic_conversations,
    traffic_dir,
    traffic_window,
    window_requests,
    window_source,
)
from peagle_ray.serve.record import CURRENT_REQUEST, RecordingEngine, TrafficRecorder, traffic_record


def record(request_id: str, prompt_ids, outputs, conversation_id=None) -> dict:
    body = {"messages": [{"role": "user", "content": "hi"}], "metadata": {"conversation_id": conversation_id}}
    return traffic_record(
        request_id, ("chat", body), prompt_ids, dict(enumerate(outputs)), {}, {"temperature": 0.0}, "tiny", None
    )


def lines(directory) -> list[dict]:
    return [json.loads(line) for path in sorted(directory.glob("traffic-*.jsonl")) for line in path.open()]


def test_recorder_writes_private_jsonl_and_rotates_within_the_cap(tmp_path):
    directory = tmp_path / "rec"
    recorder = TrafficRecorder(directory, file_bytes=1000, max_bytes=2500)
    for i in range(20):
        recorder.submit(record(f"r{i}", [1, 2, 3], [[4, 5, i]]))
    recorder.close()
    files = sorted(directory.glob("traffic-*.jsonl"))
    assert recorder.recorded == 20 and recorder.stopped_reason is None
    assert 2 <= len(files) <= 3 and sum(p.stat().st_size for p in files) <= 2500
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in files)
    kept = lines(directory)
    assert [r["id"] for r in kept] == [f"r{i}" for i in range(20 - len(kept), 20)]  # the newest survive


def test_recorder_stops_with_one_warning_when_it_cannot_write(tmp_path, caplog):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the directory should be")
    recorder = TrafficRecorder(blocker / "rec", file_bytes=1000, max_bytes=1000)
    with caplog.at_level(logging.WARNING, logger="peagle_ray.record"):
        for i in range(5):
            recorder.submit(record(f"r{i}", [1], [[2]]))
        recorder.flush()
    recorder.close()
    warnings = [r for r in caplog.records if "traffic recording stopped" in r.getMessage()]
    assert len(warnings) == 1 and "serving.record_dir" in warnings[0].getMessage()
    assert recorder.stopped_reason is not None and recorder.recorded == 0


class FakeEngine:
    """Yields vLLM-shaped outputs (RequestOutput: prompt_token_ids, outputs[index, token_ids, finish_reason])."""

    def __init__(self, steps, finished=True):
        self.steps, self.finished, self.model_config = steps, finished, "engine's own"

    async def generate(self, prompt, params, request_id, **kwargs):
        for i, step in enumerate(self.steps):
            done = self.finished and i == len(self.steps) - 1
            outputs = [
                SimpleNamespace(index=n, token_ids=ids, finish_reason="stop" if done else None) for n, ids in step
            ]
            yield SimpleNamespace(prompt_token_ids=[7, 8], outputs=outputs, finished=done)


def run_engine(engine: RecordingEngine, delta: bool, request=None) -> list:
    params = SimpleNamespace(output_kind=SimpleNamespace(name="DELTA" if delta else "FINAL_ONLY"), temperature=0.5)

    async def main():
        if request is not None:
            CURRENT_REQUEST.set(request)
        return [out async for out in engine.generate({"prompt_token_ids": [7, 8]}, params, "req-1")]

    return asyncio.run(main())


@pytest.mark.parametrize("delta", [True, False])
def test_recording_engine_accumulates_outputs_by_index(tmp_path, delta):
    recorder = TrafficRecorder(tmp_path, 1 << 20, 1 << 20)
    if delta:  # streaming: each output carries only the new tokens, completions interleaved
        steps = [[(0, [1]), (1, [5])], [(0, [2, 3])], [(1, [6]), (0, [4])]]
    else:
        steps = [[(0, [1, 2, 3, 4]), (1, [5, 6])]]
    engine = RecordingEngine(FakeEngine(steps), recorder, "tiny", {"algorithm": "peagle", "version": "m/2"})
    body = {"prompt": "hello", "metadata": {"conversation_id": "c-9"}}
    outs = run_engine(engine, delta, ("completion", body))
    recorder.close()
    assert len(outs) == len(steps) and engine.model_config == "engine's own"
    [rec] = lines(tmp_path)
    assert rec["output_ids"] == [[1, 2, 3, 4], [5, 6]] and rec["prompt_ids"] == [7, 8]
    assert rec["schema"] == SCHEMA and rec["route"] == "completion" and rec["prompt"] == "hello"
    assert rec["conversation_id"] == "c-9" and rec["messages"] is None and rec["drafter"]["version"] == "m/2"
    assert rec["sampling"]["temperature"] == 0.5 and rec["finish_reasons"] == ["stop", "stop"]


def test_recording_engine_skips_unfinished_requests(tmp_path):
    recorder = TrafficRecorder(tmp_path, 1 << 20, 1 << 20)
    run_engine(RecordingEngine(FakeEngine([[(0, [1])]], finished=False), recorder, "tiny", None), delta=False)
    recorder.close()
    assert lines(tmp_path) == []


# ---- reading it back --------------------------------------------------------------------------------------


def write_recording(directory, rows: list, tail: bytes = b"") -> None:
    directory.mkdir(parents=True, exist_ok=True)
    with (directory / "traffic-20261201T000000-1-00000.jsonl").open("wb") as f:
        for row in rows:
            f.write((row if isinstance(row, str) else json.dumps(row)).encode() + b"\n")
        f.write(tail)


def test_bad_lines_are_counted_by_reason_and_skipped(tmp_path):
    good = record("a", [1, 2], [[3, 4]])
    rows = [
        good,
        "{not json",
        {"schema": "someone-else/2", "id": "x"},
        {**good, "id": "b", "prompt_ids": [1, "two"]},
        {**good, "id": "c", "output_ids": None},
        {**good, "id": "d", "output_ids": [[]]},
        [1, 2, 3],
    ]
    write_recording(tmp_path / "rec", rows, tail=b'{"schema": "peagle-traffic/1", "id": "cut')
    bad = BadRows()
    got = list(traffic_conversations(f"traffic:{tmp_path / 'rec'}", 0.0, bad))
    assert [c.sample_id for c in got] == ["traffic:a:0"]
    assert dict(bad.counts) == {
        "invalid_json": 1,
        "unknown_shape": 2,
        "wrong_type": 1,
        "missing_field": 1,
        "no_assistant_turn": 1,
        "truncated": 1,
    }


def test_split_is_by_request_and_conversation_never_by_position(tmp_path):
    rows = [record(f"r{i}", [1, 2, i], [[3, 4], [5]], conversation_id=f"conv{i % 5}") for i in range(60)]
    write_recording(tmp_path / "rec", rows)
    conversations = list(traffic_conversations(f"traffic:{tmp_path / 'rec'}", 0.3, BadRows()))
    assert len(conversations) == 120
    by_conversation: dict[str, set] = {}
    for c in conversations:
        i = int(c.sample_id.split(":")[1][1:])
        by_conversation.setdefault(f"conv{i % 5}", set()).add(c.split)
    assert all(len(splits) == 1 for splits in by_conversation.values())  # one conversation, one split
    assert {s for splits in by_conversation.values() for s in splits} == {"train", "validation"}


def test_recorded_samples_train_on_the_output_only(tmp_path):
    write_recording(tmp_path / "rec", [record("a", [1, 2, 3], [[4, 5], [6]])])
    bad = BadRows()
    conversations = read_conversations([f"traffic:{tmp_path / 'rec'}"], 0.0, bad)
    samples = list(prepare_samples(conversations, tokenizer=None, max_length=4, bad=bad))
    assert [(s.input_ids, s.loss_mask) for s in samples] == [([1, 2, 3, 4], [0, 0, 0, 1]), ([1, 2, 3, 6], [0, 0, 0, 1])]
    assert all(s.category == "traffic" for s in samples)


def test_missing_or_empty_recording_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="is not a directory; expected the endpoint's serving.record_dir"):
        check_sources([f"traffic:{tmp_path / 'nothing'}"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="holds no recorded traffic"):
        check_sources([f"traffic:{tmp_path / 'empty'}"])


def test_record_size_settings_are_validated():
    with pytest.raises(ConfigError, match="serving.record_max_mb must be at least serving.record_file_mb"):
        build_config({"serving": {"record_dir": "x", "record_file_mb": 10, "record_max_mb": 5}})
    assert os.fspath(build_config({"serving": {"record_dir": "r"}}).serving.record_dir) == "r"


def test_a_traffic_window_reads_only_the_requests_recorded_inside_it(tmp_path):
    directory = tmp_path / "rec"
    directory.mkdir()
    rows = [{**record(f"r{i}", [1, 2], [[3, 4]]), "time": 100.0 + i} for i in range(5)]
    rows.append({**record("untimed", [1], [[2]]), "time": None})  # no time: outside any bounded window
    (directory / "traffic-0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"cut off')
    assert traffic_window(f"traffic:{directory}") == (float("-inf"), float("inf"))
    source = window_source(directory, 101.0, 103.0)
    assert source == f"traffic:{directory}?since=101.0&until=103.0"
    assert traffic_dir(source) == directory and traffic_window(source) == (101.0, 103.0)
    assert window_source(directory) == f"traffic:{directory}" and window_source(directory, until=7.5).endswith(
        "?until=7.5"
    )
    bad = BadRows()
    ids = [c.sample_id for c in traffic_conversations(source, 0.0, bad)]
    assert ids == ["traffic:r2:0", "traffic:r3:0"]  # since < time <= until
    assert bad.total() == 1  # the cut-off line is bad wherever the window is; older requests are not bad rows
    assert window_requests(window_source(directory, 102.0)) == (2, 104.0)
    assert window_requests(window_source(directory, 104.0)) == (0, None)
    assert window_requests(f"traffic:{directory}") == (6, 104.0)  # the untimed request counts where unbounded
    with pytest.raises(ConfigError, match=r"since must be a Unix time in seconds; got 'yesterday'"):
        check_sources([f"traffic:{directory}?since=yesterday"])
    with pytest.raises(ConfigError, match=r"takes since= and until=; got \['from'\]"):
        check_sources([f"traffic:{directory}?from=1"])
