"""Ray Data capture pipeline: prepared samples -> Serve-hosted target -> validated training records.

Shape legend: T tokens, H target hidden size, A = n_aux * H.

Record (one per conversation, the `Record` type below): sample_id, split, input_ids (T,) int64, loss_mask (T,)
int8, aux_hidden (T, A) and last_hidden (T, H) in the target's dtype (float32 is made where training needs
it). Records come out of an actor pool (CaptureStage, stage.py) that sends each batch's conversations to the
target in one request, which vLLM prefills together. A capture that fails validation (token ids differ from
the request, NaN/Inf, wrong shape) stays in the stream as an error row and is counted and dropped by the
consumer, so nothing stops the run.

    online:  iter_records(capture_dataset(samples, ...), bad)        streamed; nothing left on disk
    offline: write_offline(..., out_dir); read_offline(out_dir)      shards + manifest; reruns skip done ids
"""

from __future__ import annotations

import itertools
import json
import os
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TypedDict

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from peagle_ray.capture.stage import WIRE_VIEWS, CaptureStage
from peagle_ray.data.prepare import BadRows, TokenizedSample

MANIFEST = "manifest.json"


class Record(TypedDict):
    """One captured conversation: what capture yields (online) or writes to shards (offline), and what the
    training workers, validation and the benchmarks read."""

    sample_id: str
    split: str  # "train" or "validation"
    input_ids: torch.Tensor  # (T,) int64
    loss_mask: torch.Tensor  # (T,) int8: 1 where the token is the assistant's (trained on)
    aux_hidden: torch.Tensor  # (T, A) the target's dtype: its aux-layer hidden states, concatenated
    last_hidden: torch.Tensor  # (T, H) the target's dtype: its last-layer (pre-norm) hidden state


SHARD_TENSORS = ("input_ids", "loss_mask", "aux_hidden", "last_hidden")  # per record, saved as "<i>.<name>"


def make_record(sample_id: str, split: str, tensor: Callable[[str], torch.Tensor], prefix: str = "") -> Record:
    """A Record whose tensors are tensor(prefix + name), name in SHARD_TENSORS (a shard stores "<i>.<name>")."""
    return Record(
        sample_id=sample_id,
        split=split,
        input_ids=tensor(prefix + "input_ids"),
        loss_mask=tensor(prefix + "loss_mask"),
        aux_hidden=tensor(prefix + "aux_hidden"),
        last_hidden=tensor(prefix + "last_hidden"),
    )


def capture_dataset(
    samples: Iterable[TokenizedSample], num_layers: int, hidden_size: int, batch_size: int, num_actors: int
):
    """A lazy, streaming Ray Dataset of captured rows (error rows included; see iter_records)."""
    import ray

    items = [
        {
            "sample_id": s.sample_id,
            "split": s.split,
            "input_ids": np.asarray(s.input_ids, dtype=np.int64),
            "loss_mask": np.asarray(s.loss_mask, dtype=np.int8),
        }
        for s in samples
    ]
    if not items:
        raise ValueError("nothing to capture: the prepared data has no samples")
    # a block per batch: each block is one map task, so the actors take batches side by side (from one
    # block of many batches an actor would capture them one after another while the others wait)
    blocks = -(-len(items) // batch_size)
    return ray.data.from_items(items, override_num_blocks=blocks).map_batches(
        CaptureStage,
        fn_constructor_kwargs={"num_layers": num_layers, "hidden_size": hidden_size},
        batch_size=batch_size,
        batch_format="numpy",
        compute=ray.data.ActorPoolStrategy(size=num_actors),
        num_cpus=0,  # the actors only wait on the target; its engine does the work
    )


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bfloat16": how the wire format (stage.py) and the rows name a dtype."""
    return str(dtype).removeprefix("torch.")


def as_array(tensor: torch.Tensor) -> np.ndarray:
    """A tensor's numpy view; dtypes numpy lacks (bfloat16) as their bit pattern (stage.WIRE_VIEWS)."""
    name = dtype_name(tensor.dtype)
    return (tensor.view(getattr(torch, WIRE_VIEWS[name])) if name in WIRE_VIEWS else tensor).numpy()


def as_tensor(array: np.ndarray, dtype: str, copy: bool = True) -> torch.Tensor:
    """A tensor of `dtype` (a torch dtype's name) from a wire array (stage.py), as_array's inverse. `copy`:
    owning writable memory (Ray Data's arrays may be read-only views of its blocks)."""
    tensor = torch.from_numpy(np.array(array) if copy else array)
    return tensor.view(getattr(torch, dtype)) if dtype in WIRE_VIEWS else tensor


def to_record(row: dict) -> Record:
    """A captured Ray Data row (numpy, possibly read-only; stage.py) -> a record of torch tensors (copies); the
    hidden states stay in the target's dtype."""
    dtype = str(row["hidden_dtype"])
    return make_record(
        str(row["sample_id"]),
        str(row["split"]),
        lambda k: (
            as_tensor(row[k], dtype) if k in ("aux_hidden", "last_hidden") else torch.from_numpy(np.array(row[k]))
        ),
    )


def to_row(record: Record) -> dict:
    """to_record's inverse: a record as a captured row of numpy arrays (its hidden states' dtype in
    hidden_dtype), for a Ray Dataset made from records."""
    row = {k: as_array(v) if isinstance(v, torch.Tensor) else v for k, v in record.items()}
    return {**row, "hidden_dtype": dtype_name(record["aux_hidden"].dtype)}


def valid_records(
    rows: Iterable[dict], bad: BadRows, seen: Callable[[Record | None], None] | None = None
) -> Iterator[Record]:
    """Records from captured rows (Ray Data's numpy rows); an error row is counted in `bad` under its reason
    and skipped. `seen` is called once per row, with its record or None."""
    for row in rows:
        record = None if row.get("error") else to_record(row)
        if record is None:
            bad.add(str(row["error"]), str(row["sample_id"]))
        if seen is not None:
            seen(record)
        if record is not None:
            yield record


def iter_records(
    rows: Iterable[dict], bad: BadRows, total: int | None = None, desc: str = "capture"
) -> Iterator[Record]:
    """valid_records with a progress bar (tokens/s, bad rows)."""
    from tqdm import tqdm

    start, tokens = time.monotonic(), 0
    with tqdm(total=total, desc=desc, unit="sample") as bar:

        def seen(record: Record | None) -> None:
            nonlocal tokens
            bar.update(1)
            if record is not None:
                tokens += len(record["input_ids"])
                bar.set_postfix(tok_s=f"{tokens / max(time.monotonic() - start, 1e-9):.0f}", bad=bad.total())

        yield from valid_records(rows, bad, seen)


# ---- offline shards ----------------------------------------------------------------------------------


def read_manifest(out_dir: Path) -> dict:
    path = Path(out_dir) / MANIFEST
    return json.loads(path.read_text()) if path.is_file() else {"shards": []}


def done_sample_ids(out_dir: Path) -> set[str]:
    return {sid for shard in read_manifest(out_dir)["shards"] for sid in shard["sample_ids"]}


def _write_shard(out_dir: Path, records: list[Record], manifest: dict) -> None:
    index = len(manifest["shards"])
    name = f"shard-{index:05d}.safetensors"
    tensors = {f"{i}.{key}": r[key].contiguous() for i, r in enumerate(records) for key in SHARD_TENSORS}  # type: ignore[literal-required]
    save_file(tensors, str(out_dir / name))
    manifest["shards"].append(
        {"file": name, "sample_ids": [r["sample_id"] for r in records], "splits": [r["split"] for r in records]}
    )
    tmp = out_dir / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, out_dir / MANIFEST)  # the manifest only ever names complete shards


def write_offline(records: Iterable[Record], out_dir: Path, shard_size: int) -> int:
    """Append records to safetensors shards under `out_dir`, updating manifest.json after each shard."""
    out_dir.mkdir(parents=True, exist_ok=True)
    manifest = read_manifest(out_dir)
    pending: list[Record] = []
    written = 0
    for record in records:
        pending.append(record)
        if len(pending) == shard_size:
            _write_shard(out_dir, pending, manifest)
            written, pending = written + len(pending), []
    if pending:
        _write_shard(out_dir, pending, manifest)
        written += len(pending)
    return written


def read_shard(item: dict) -> list[Record]:
    """Records of one shard: item = {"path", "ids", "splits"} (a manifest entry with its full path)."""
    tensors = load_file(item["path"])
    return [
        make_record(sample_id, split, tensors.__getitem__, f"{i}.")
        for i, (sample_id, split) in enumerate(zip(item["ids"], item["splits"], strict=True))
    ]


def read_split(out_dir: Path, split: str, rank: int = 0, world: int = 1) -> Iterator[Record]:
    """One rank's records of a split, read lazily shard by shard: every world-th record of the split, the same
    number on every rank (a remainder of fewer than `world` records is left out, so every rank's data ends
    at the same step)."""
    out_dir = Path(out_dir)
    entries = [
        (shard["file"], i, sample_id)
        for shard in read_manifest(out_dir)["shards"]
        for i, (sample_id, s) in enumerate(zip(shard["sample_ids"], shard["splits"], strict=True))
        if s == split
    ]
    mine = entries[rank::world][: len(entries) // world]
    for file, group in itertools.groupby(mine, key=lambda entry: entry[0]):
        with safe_open(str(out_dir / file), framework="pt") as f:
            for _, i, sample_id in group:
                yield make_record(sample_id, split, f.get_tensor, f"{i}.")


def read_offline(out_dir: Path) -> Iterator[Record]:
    """The records of every shard, in the order they were written."""
    for shard in read_manifest(out_dir)["shards"]:
        yield from read_shard(
            {"path": str(Path(out_dir) / shard["file"]), "ids": shard["sample_ids"], "splits": shard["splits"]}
        )
