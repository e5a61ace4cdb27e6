"""The demo's per-stage minutes (pure: the clock is replaced)."""

from peagle_ray import demo


def test_each_stage_lasts_until_the_next_starts_and_the_table_sums_them(monkeypatch, capsys):
    clock = iter([0.0, 0.0, 90.0, 330.0, 360.0])  # constructor, start a, start b, finish, (unused)
    monkeypatch.setattr(demo.time, "monotonic", lambda: next(clock))
    stages = demo.Stages()
    stages.start("data", "sharegpt:200")
    stages.start("train")
    stages.finish()
    assert stages.minutes() == {"data": 1.5, "train": 4.0}
    assert stages.table().splitlines() == [
        "| Stage | Minutes |",
        "|---|---:|",
        "| data | 1.5 |",
        "| train | 4.0 |",
        "| total | 5.5 |",
    ]
    assert "[demo] === data: sharegpt:200 (0.0 min in) ===" in capsys.readouterr().out
