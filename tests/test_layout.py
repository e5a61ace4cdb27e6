from pathlib import Path

from peagle_ray import layout
from peagle_ray.config import build_config


def test_every_path_under_storage_and_the_run_names():
    cfg = build_config(
        {"training": {"storage_path": "/runs/x", "run_name": "chat"}, "drafter": {"algorithm": "peagle"}}
    )
    assert layout.drafter_dir(cfg) == Path("/runs/x/chat/export")
    assert layout.export_dir("/runs/x", layout.run_name_for(cfg, "eagle3")) == Path("/runs/x/chat-eagle3/export")
    assert layout.run_name_for(cfg, "peagle") == "chat"
    assert layout.run_summary("/runs/x", "chat") == Path("/runs/x/chat/summary.json")
    assert layout.crash_marker("/runs/x", "chat") == Path("/runs/x/chat.crashed")
    assert layout.mlflow_dir("/runs/x") == Path("/runs/x/mlflow")
    assert layout.eval_dir("/runs/x", "validation") == Path("/runs/x/eval")
    assert layout.eval_dir("/runs/x", "mt-bench") == Path("/runs/x/eval-mt-bench")
    assert layout.adapt_dir("/runs/x", "20261202-1200-ab12") == Path("/runs/x/adapt/20261202-1200-ab12")
    assert layout.bench_dir(cfg, "peers") == Path("/runs/x/bench/peers")
    assert layout.storage(cfg) == Path("/runs/x")


def test_metric_names():
    assert layout.VAL_ACCEPTANCE_LENGTH == "val/acceptance_length"
    assert [layout.acceptance_metric(i) for i in (1, 4)] == ["val/acceptance_pos_1", "val/acceptance_pos_4"]
    assert layout.acceptance_metric(3).startswith(layout.VAL_ACCEPTANCE_POS)
