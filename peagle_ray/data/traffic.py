"""Recorded endpoint traffic as a data source: `data.sources: ["traffic:DIR"]`.

DIR holds the JSONL files the endpoint writes with `serving.record_dir` (serve/record.py writes them; the
format is defined here, where it is read). Each finished request becomes one sample per completion: the
prompt's token ids as the target saw them, then the tokens it generated (the loss mask covers those), so
no chat template is re-applied and nothing is regenerated.

Split by request, never by position: every completion of one request, and every request carrying the
same `conversation_id`, land in the same split (a stable hash of the conversation id, else of the
request id), so a held-out request's prompt was never trained on.

Bad lines are counted under a reason and skipped: a file cut off mid-line by a crash (`truncated`), a
line that is not JSON (`invalid_json`) or not UTF-8, a JSON line of another program (`unknown_shape`),
ids that are not lists of non-negative integers (`wrong_type`), a missing field (`missing_field`), a
request that generated nothing (`no_assistant_turn`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from peagle_ray.config import ConfigError
from peagle_ray.data.prepare import BadRow, BadRows, Conversation, split_of

SCHEMA = "peagle-traffic/1"
FILE_GLOB = "traffic-*.jsonl"
PREFIX = "traffic:"
CATEGORY = "traffic"


def is_traffic(source: str) -> bool:
    return source.startswith(PREFIX)


def traffic_dir(source: str) -> Path:
    """ "traffic:/srv/record" or "traffic:/srv/record?since=1764600000.5" -> Path("/srv/record")."""
    return Path(source[len(PREFIX) :].partition("?")[0])


def traffic_window(source: str) -> tuple[float, float]:
    """(since, until): a traffic source's requests count where since < time <= until (Unix seconds).

    e.g. "traffic:/srv/record?since=1764600000.5&until=1764603600" -> (1764600000.5, 1764603600.0);
    "traffic:/srv/record" -> (-inf, inf): every request."""
    from urllib.parse import parse_qs

    query = parse_qs(source.partition("?")[2], keep_blank_values=True)
    unknown = sorted(query.keys() - {"since", "until"})
    if unknown:
        raise ConfigError(f"data.sources entry {source!r}: a traffic source takes since= and until=; got {unknown}")
    bounds = []
    for name, default in (("since", float("-inf")), ("until", float("inf"))):
        value = query.get(name, [None])[-1]
        try:
            bounds.append(default if value is None else float(value))
        except ValueError:
            raise ConfigError(
                f"data.sources entry {source!r}: {name} must be a Unix time in seconds; got {value!r}"
            ) from None
    return bounds[0], bounds[1]


def window_source(directory: str | Path, since: float | None = None, until: float | None = None) -> str:
    """The traffic source of `directory` between `since` and `until` (None: open); traffic_window's inverse."""
    bounds = "&".join(f"{name}={value!r}" for name, value in (("since", since), ("until", until)) if value is not None)
    return f"{PREFIX}{directory}" + (f"?{bounds}" if bounds else "")


def window_requests(source: str) -> tuple[int, float | None]:
    """(requests recorded inside the source's window, the newest one's time): what an adaptation would learn
    from. Unreadable lines are not counted (reading the data counts them as bad rows)."""
    (since, until), count, newest_time = traffic_window(source), 0, float("-inf")
    for path in traffic_files(traffic_dir(source)):
        with path.open("rb") as f:
            for raw in f:
                try:
                    when = record_time(parse_record(raw))
                except BadRow:
                    continue
                if inside(when, since, until):
                    count, newest_time = count + 1, max(when, newest_time)
    return count, (newest_time if newest_time > float("-inf") else None)


def inside(when: float, since: float, until: float) -> bool:
    """since < when <= until; an open bound (-inf / inf) admits a record without a time (when = -inf) too."""
    return (since == float("-inf") or since < when) and when <= until


def record_time(record: dict) -> float:
    """A record's "time" (Unix seconds; -inf where it has none, so a since filter skips it)."""
    when = record.get("time")
    return float(when) if isinstance(when, int | float) and not isinstance(when, bool) else float("-inf")


def traffic_files(directory: Path) -> list[Path]:
    """The recording files of a directory, oldest first (names start with their writer's start time)."""
    return sorted(Path(directory).glob(FILE_GLOB))


def check_traffic_source(source: str) -> None:
    directory = traffic_dir(source)
    traffic_window(source)  # a malformed window is refused here, before any work
    if not directory.is_dir():
        raise FileNotFoundError(
            f"data.sources entry {source!r}: {directory} is not a directory; expected the endpoint's serving.record_dir"
        )
    if not traffic_files(directory):
        raise FileNotFoundError(
            f"data.sources entry {source!r}: {directory} holds no recorded traffic ({FILE_GLOB}); start the "
            "endpoint with serving.record_dir set and send it requests"
        )


def traffic_conversations(
    source: str, validation_fraction: float, bad: BadRows, max_row_bytes: int | None = None
) -> Iterator[Conversation]:
    """Every recorded completion of `traffic:DIR` (`?since=A&until=B`: of the requests recorded in that window,
    traffic_window) as a Conversation carrying prompt_ids / output_ids."""
    since, until = traffic_window(source)
    for path in traffic_files(traffic_dir(source)):
        with path.open("rb") as f:
            for i, raw in enumerate(f):
                row_id = f"{path.name}:{i}"
                try:
                    record = parse_record(raw, max_row_bytes)
                except BadRow as err:
                    bad.skip(err, row_id)
                    continue
                if not inside(record_time(record), since, until):
                    continue  # outside the window (an earlier round's, or newer): not a bad row
                key = record.get("conversation_id") or record["id"]
                split = split_of(f"{PREFIX}{key}", validation_fraction)
                for n, output in enumerate(record["output_ids"]):
                    if not output:
                        bad.add("no_assistant_turn", f"{row_id}#{n}", "the target generated nothing")
                        continue
                    yield Conversation(
                        f"{PREFIX}{record['id']}:{n}",
                        _messages(record),
                        CATEGORY,
                        split,
                        prompt_ids=record["prompt_ids"],
                        output_ids=output,
                    )


def parse_record(raw: bytes, max_row_bytes: int | None = None) -> dict:
    """One line of a recording file, checked; BadRow names what is wrong."""
    if max_row_bytes is not None and len(raw) > max_row_bytes:
        raise BadRow("too_large", f"{len(raw)} bytes > data.max_row_bytes {max_row_bytes}")
    if not raw.endswith(b"\n"):
        raise BadRow("truncated", "the file ends inside this line (a writer stopped mid-record)")
    try:
        record = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as err:
        raise BadRow("invalid_utf8", str(err)) from None
    except (json.JSONDecodeError, RecursionError) as err:
        raise BadRow("invalid_json", str(err)[:200]) from None
    if not isinstance(record, dict) or record.get("schema") != SCHEMA:
        got = record.get("schema") if isinstance(record, dict) else type(record).__name__
        raise BadRow("unknown_shape", f"not a {SCHEMA} record (schema {got!r})")
    for name in ("id", "prompt_ids", "output_ids"):
        if record.get(name) is None:
            raise BadRow("missing_field", name)
    if not isinstance(record["id"], str):
        raise BadRow("wrong_type", f"id must be a string; got {type(record['id']).__name__}")
    if not _token_ids(record["prompt_ids"]) or not record["prompt_ids"]:
        raise BadRow("wrong_type", "prompt_ids must be a non-empty list of non-negative integers")
    outputs = record["output_ids"]
    if not isinstance(outputs, list) or not all(_token_ids(o) for o in outputs):
        raise BadRow("wrong_type", "output_ids must be a list of lists of non-negative integers")
    return record


def _token_ids(value: object) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value)


def _messages(record: dict) -> list[dict]:
    """The request as sent, for people reading the data (training uses the token ids)."""
    messages = record.get("messages")
    if isinstance(messages, list):
        return messages
    prompt = record.get("prompt")
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else []
