"""The training-memory benchmark runs its configurations in subprocesses and reports each (tiny sizes here)."""

from peagle_ray.bench import train_memory


def test_train_memory_reports_every_configuration():
    result = train_memory.run(seq_lens=(48,), depths=(3,), segment_length=40, draft_vocab_size=256,
                              progress=lambda _line: None)  # fmt: skip
    rows = result["rows"]
    assert [(r["seq_len"], r["depths"], r["partitioned"]) for r in rows] == [(48, 3, True), (48, 3, False)]
    assert all("error" not in r for r in rows), rows
    assert rows[0]["segments"] >= 2 and rows[1]["segments"] == 1
    assert rows[0]["elements"] == rows[1]["elements"]  # same seeded COD sampling
    assert all(r["peak_rss_mb"] > 0 and r["tokens_per_s"] > 0 for r in rows)
