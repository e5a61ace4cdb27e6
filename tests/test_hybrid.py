"""The hybrid decoder's pure parts (peagle_ray/hybrid.py): which source drafts, and the counts per source."""

import logging
import time
from types import SimpleNamespace

import pytest

from peagle_ray.hybrid import (
    ENGINE_ARGS,
    STATS,
    VLLM_VERSION,
    StatsFile,
    choose,
    count_step,
    drafter_expectation,
    engine_config,
    hybrid_proposer,
    read_stats,
    runner_problem,
    unsupported,
)
from peagle_ray.spec_counters import SpecStats


def test_suffix_drafts_where_its_score_reaches_the_threshold_else_the_drafter():
    drafts, sources = choose(
        [[5, 6], [7, 8], [1, 1], [4, 4]],
        [([1, 2, 3], 2.5), ([9], 0.4), ([], 9.0), ([2, 2], 2.0)],  # no tokens: nothing to take
        threshold=2,
    )
    assert drafts == [[1, 2, 3], [7, 8], [1, 1], [2, 2]]
    assert sources == ["suffix", "drafter", "drafter", "suffix"]
    with pytest.raises(ValueError, match="one draft per request from each source; got 1 and 2"):
        choose([[1]], [([1], 1.0), ([2], 1.0)], 1)


def test_counts_per_source_add_up_to_what_vllm_counts_over_all_drafts():
    stats: dict[str, SpecStats] = {}
    count_step(stats, ["suffix", "drafter", "drafter"], [3, 2, 0], [2, 0, 0])
    count_step(stats, ["suffix", "suffix", "drafter"], [1, 4, 2], [1, 4, 1])
    assert stats["suffix"] == SpecStats(3, 8, 7, [3, 2, 1, 1])
    assert stats["drafter"] == SpecStats(2, 4, 1, [1, 0])
    assert stats["suffix"].acceptance_length == pytest.approx(1 + 7 / 3)
    overall = stats["suffix"] + stats["drafter"]  # vLLM's own counters over every draft
    assert overall == SpecStats(5, 12, 8, [4, 2, 1, 1])
    with pytest.raises(ValueError, match=r"accepted tokens must be 0..2 \(the draft's length\); got 3"):
        count_step(stats, ["drafter"], [2], [3])


def test_the_adaptive_threshold_is_what_the_drafter_delivers_per_draft():
    assert drafter_expectation({}) == 0.0  # before its first draft: any suffix draft with a score is taken
    stats: dict[str, SpecStats] = {}
    count_step(stats, ["drafter", "drafter", "suffix"], [4, 4, 4], [1, 0, 4])
    assert drafter_expectation(stats) == pytest.approx(0.5)  # 1 token accepted over 2 drafts
    drafts, sources = choose([[5, 6], [7, 8]], [([1, 2], 0.6), ([3], 0.4)], drafter_expectation(stats))
    assert sources == ["suffix", "drafter"] and drafts == [[1, 2], [7, 8]]
    from peagle_ray.config import ConfigError, build_config

    assert build_config({"serving": {"hybrid_threshold": "drafter"}}).serving.hybrid_threshold == "drafter"
    with pytest.raises(ConfigError, match="hybrid_threshold"):
        build_config({"serving": {"hybrid_threshold": 0}})


class _Runner:
    """What the proposal step reads of vLLM's model runner: its config and its speculative config."""

    def __init__(self, additional_config, method="eagle3"):
        self.vllm_config = SimpleNamespace(additional_config=additional_config)
        self.speculative_config = SimpleNamespace(method=method, use_eagle=lambda: method == "eagle3")
        self.input_batch = None


def test_an_engine_not_asking_for_the_hybrid_proposes_as_before_and_another_vllm_falls_back(caplog):
    proposed = [[5, 6, 7]]
    propose = hybrid_proposer(lambda runner, scheduler_output, sampled: proposed, VLLM_VERSION)
    assert propose(_Runner({}), None, [[1]]) is proposed  # not asked: the drafter's drafts, untouched
    old = hybrid_proposer(lambda runner, scheduler_output, sampled: proposed, "0.31.2")
    runner = _Runner(engine_config(2.0))
    with caplog.at_level(logging.ERROR, logger="peagle_ray.hybrid"):
        assert old(runner, None, [[1]]) is proposed and old(runner, None, [[2]]) is proposed
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert errors == [unsupported("0.31.2")]  # one error, then the drafter alone drafts
    assert "written for vLLM 0.32.0 and this is 0.31.2: the drafter alone drafts" in errors[0]
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="peagle_ray.hybrid"):
        assert propose(_Runner(engine_config(), method="ngram"), None, [[1]]) is proposed
    assert "needs an EAGLE-3 or P-EAGLE drafter; this engine's speculative method is ngram" in caplog.text


def test_the_counts_per_source_reach_another_process_through_a_file(tmp_path):
    path = tmp_path / "by_source.json"
    assert read_stats(path) == {} and read_stats(None) == {}
    STATS.clear()
    try:
        count_step(STATS, ["suffix", "drafter"], [3, 2], [2, 0])
        StatsFile(str(path), period_s=0.01).touch()
        deadline = time.monotonic() + 10
        while not path.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert read_stats(path) == {"suffix": SpecStats(1, 3, 2, [1, 1, 0]), "drafter": SpecStats(1, 2, 0, [0, 0])}
    finally:
        STATS.clear()
    path.write_text("{half")
    assert read_stats(path) == {}


class _Runner032:
    """The two methods the plugin wraps, with vLLM 0.32.0's parameters."""

    def propose_draft_token_ids(
        self,
        scheduler_output,
        sampled_token_ids,
        sampling_metadata,
        hidden_states,
        sample_hidden_states,
        aux_hidden_states,
        spec_decode_metadata,
        common_attn_metadata,
        slot_mappings,
    ): ...

    def execute_model(self, scheduler_output, intermediate_tensors=None): ...


def test_the_plugin_patches_only_the_runner_signatures_it_was_written_for():
    assert runner_problem(_Runner032, VLLM_VERSION) is None
    assert runner_problem(_Runner032, "0.33.0") == unsupported("0.33.0")

    class Changed(_Runner032):
        def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, draft_state): ...

    problem = runner_problem(Changed, VLLM_VERSION)
    assert problem is not None and "Changed.propose_draft_token_ids" in problem
    assert "('self', 'scheduler_output', 'sampled_token_ids', 'draft_state')" in problem and "not patched" in problem

    class Missing:
        pass

    assert "Missing.propose_draft_token_ids" in (runner_problem(Missing, VLLM_VERSION) or "")


@pytest.mark.vllm
def test_the_installed_vllm_has_the_runner_the_plugin_wraps():
    """Fails the day vLLM changes the model runner underneath the hybrid (then re-pin, as Arctic Inference does)."""
    import vllm
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from peagle_ray.hybrid import installed_vllm

    assert installed_vllm() == vllm.__version__  # read from the distribution's metadata, without importing vLLM
    assert runner_problem(GPUModelRunner) is None
    assert getattr(GPUModelRunner, "_peagle_hybrid", True) is not False


def test_hybrid_engines_turn_async_scheduling_off_explicitly():
    from peagle_ray.engine import cli_args

    assert ENGINE_ARGS == {"async_scheduling": False}
    assert cli_args({"enforce_eager": False, **ENGINE_ARGS}) == ["--no-async-scheduling"]
    assert cli_args({"async_scheduling": None, "enforce_eager": True}) == ["--enforce-eager"]
