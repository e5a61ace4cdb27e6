import pytest

from peagle_ray.config import ConfigError, PeagleConfig, build_config, dump_config, load_config
from tests.conftest import REPO


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("target.dtype=int8", r"target\.dtype: Input should be 'float32', 'bfloat16', 'float16' or 'auto'; got 'int8'"),
        ("target.kv_cache_gib=0", r"target\.kv_cache_gib: Input should be greater than or equal to 1; got 0"),
        ("data.max_length=0", r"data\.max_length: Input should be greater than 0; got 0"),
        ("data.validation_fraction=1.5", r"data\.validation_fraction: Input should be less than 1; got 1\.5"),
        ("capture.mode=sideways", r"capture\.mode: Input should be 'online' or 'offline'; got 'sideways'"),
        (
            "capture.aux_layer_ids=[2,-1]",
            r"capture\.aux_layer_ids: must be a non-empty list of layer ids >= 0; got \[2, -1\]",
        ),
        ("drafter.algorithm=medusa", r"drafter\.algorithm: Input should be 'peagle' or 'eagle3'; got 'medusa'"),
        ("drafter.num_depths=0", r"drafter\.num_depths: Input should be greater than or equal to 1; got 0"),
        ("training.learning_rate=-1", r"training\.learning_rate: Input should be greater than 0; got -1"),
        (
            "training.depth_weights=[1,2]",
            r"training\.depth_weights must have one weight per trained depth \(4\); got 2 weights",
        ),
        ("drafter.ttt_steps=3", r"^drafter\.ttt_steps applies only to algorithm 'eagle3'; got algorithm 'peagle'"),
        ("drafter.k_train=3", r"^drafter\.k_train must be at least drafter\.num_depths \(4\), the K served; got 3"),
        ("training.loss=mse", r"training\.loss: Input should be 'kl' or 'argmax_ce'; got 'mse'"),
        ("tracking.port=70000", r"tracking\.port: Input should be less than 65536; got 70000"),
        ("serving.max_tokens_limit=0", r"serving\.max_tokens_limit: Input should be greater than 0; got 0"),
        ("eval.k_values=[0,2]", r"eval\.k_values: must be a non-empty list of K >= 1; got \[0, 2\]"),
        ("training.lr=1", r"training\.lr: Extra inputs are not permitted; got 1"),
        ("training.num_workers=0", r"training\.num_workers: must be at least 1; got 0"),
        ("training.num_workers=[2,1]", r"training\.num_workers: must be N or \[min, max\] with 1 <= min <= max"),
        ("training.num_workers=[0,2]", r"training\.num_workers: must be N or \[min, max\]"),
        ("training.placement_strategy=RANDOM", r"training\.placement_strategy: Input should be 'PACK', 'SPREAD'"),
        ("capture.num_replicas=0", r"capture\.num_replicas: Input should be greater than 0; got 0"),
    ],
)
def test_bad_value_names_field_rule_and_value(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_num_workers_is_a_count_or_an_elastic_range():
    assert load_config(None, ["training.num_workers=3"]).training.worker_range == (3, 3)
    assert load_config(None, ["training.num_workers=[1,4]"]).training.worker_range == (1, 4)


def test_cod_floor_above_ratio_is_rejected():
    with pytest.raises(
        ConfigError, match=r"drafter\.cod_min_ratio must not exceed drafter\.cod_keep_ratio; got 0\.8 > 0\.7"
    ):
        build_config({"drafter": {"cod_min_ratio": 0.8}})


def test_eagle3_trains_ttt_steps_depths():
    cfg = build_config(
        {
            "drafter": {"algorithm": "eagle3", "num_depths": 3, "ttt_steps": 7},
            "training": {"depth_weights": [1, 1, 1, 1, 1, 1, 1]},
        }
    )
    assert cfg.drafter.trained_depths == 7
    assert build_config({"drafter": {"num_depths": 5}}).drafter.trained_depths == 5


def test_peagle_trains_k_train_depths_and_serves_num_depths():
    cfg = build_config({"drafter": {"num_depths": 4, "k_train": 8}, "training": {"depth_weights": [1] * 8}})
    assert cfg.drafter.trained_depths == 8 and cfg.drafter.num_depths == 4
    with pytest.raises(ConfigError, match=r"drafter\.k_train applies only to algorithm 'peagle'"):
        build_config({"drafter": {"algorithm": "eagle3", "k_train": 8}})


def test_malformed_override_is_rejected():
    with pytest.raises(ConfigError, match=r"override must look like section\.field=value; got 'training\.max_steps'"):
        load_config(None, ["training.max_steps"])


def test_every_field_has_a_docstring():
    sections = [PeagleConfig] + [f.annotation for f in PeagleConfig.model_fields.values()]
    undocumented = [f"{s.__name__}.{n}" for s in sections for n, f in s.model_fields.items() if not f.description]
    assert undocumented == []


def test_yaml_round_trip(tmp_path):
    cfg = load_config(None, ["drafter.num_depths=7", "training.depth_weights=[1,1,1,1,1,1,0.5]"])
    path = tmp_path / "resolved.yaml"
    dump_config(cfg, path)
    assert load_config(path) == cfg
    assert load_config(path).drafter.num_depths == 7


@pytest.mark.parametrize("name", ["demo.yaml", "qwen3-8b-gpu.yaml"])
def test_shipped_configs_are_valid(name):
    cfg = load_config(REPO / "configs" / name)
    assert cfg.drafter.algorithm == "peagle"


def test_cache_dir_follows_env(monkeypatch, tmp_path):
    monkeypatch.setenv("PEAGLE_RAY_CACHE", str(tmp_path))
    assert PeagleConfig().cache_path() == tmp_path
    assert build_config({"target": {"cache_dir": "/elsewhere"}}).cache_path().as_posix() == "/elsewhere"
