"""Capture through the Ray Serve-hosted vLLM target and Ray Data, on the tiny target (real engine, real Ray)."""

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from peagle_ray.capture.pipeline import capture_dataset, iter_records, read_offline, read_split, write_offline
from peagle_ray.capture.reference import hf_hidden_states
from peagle_ray.capture.run import run_capture_offline, samples_to_capture, target_session
from peagle_ray.capture.stage import BadCapture, validate_capture
from peagle_ray.config import build_config, with_values
from peagle_ray.data import run as data_stage
from peagle_ray.data.prepare import BadRows, PreparedData, TokenizedSample
from peagle_ray.data.run import prompt_writer
from peagle_ray.serve.app import free_port
from tests.helpers.train_data import PROMPTS as TRAIN_PROMPTS

PROMPTS = TRAIN_PROMPTS[:6]  # the shared tiny prompts (tests/helpers/train_data.py)


@pytest.fixture(scope="module")
def session(tiny_target, tmp_path_factory, ray_local):
    tmp = tmp_path_factory.mktemp("capture")
    (tmp / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
    cfg = build_config(
        {
            "target": {"path": str(tiny_target), "max_model_len": 256, "kv_cache_gib": 1},
            "data": {
                "sources": [str(tmp / "prompts.txt")],
                "max_new_tokens": 12,
                "output_dir": str(tmp / "data"),
                "validation_fraction": 0.3,
            },
            "capture": {"output_dir": str(tmp / "hidden"), "batch_size": 4},
            "serving": {"port": free_port()},  # Serve's HTTP proxy: not 8000, which another worker may hold
        }
    )
    with target_session(cfg) as s:
        yield cfg, s


@pytest.fixture(scope="module")
def model(tiny_target):
    return AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()


def test_captured_hidden_states_equal_transformers(session, model):
    cfg, s = session
    ids = list(range(20, 83))
    answer = s.handle.capture_batch.remote([ids, ids[:30]]).result()  # one request, prefilled together
    hf_aux, hf_last = hf_hidden_states(model, torch.tensor(ids), s.info.default_aux_layer_ids())
    assert s.info.default_aux_layer_ids() == [2, 3, 5] and s.handle.hidden_dtype.remote().result() == "float32"
    for n, captured in zip((63, 30), answer["items"], strict=True):
        aux, last = validate_capture(np.array(ids[:n]), captured, s.num_layers_captured, s.info.hidden_size, "float32")
        assert aux.shape == (n, 3 * 96) and aux.dtype == np.float32
        torch.testing.assert_close(torch.from_numpy(aux), hf_aux[:n], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(torch.from_numpy(last), hf_last[:n], atol=1e-4, rtol=1e-4)
    assert answer["timing"]["engine_s"] > 0 and answer["timing"]["read_s"] > 0
    assert s.handle.storage_files.remote().result() == []  # files and locks were cleaned up


def test_regeneration_is_the_targets_greedy_answer(session, model):
    _, s = session
    prompt = list(range(30, 45))
    generated = s.handle.generate.remote(prompt, 10, 0.0).result()
    with torch.no_grad():
        expected = model.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False)[0, 15:].tolist()
    assert generated == expected
    assert s.handle.storage_files.remote().result() == []


def test_magpie_prompts_are_written_by_the_target_one_seed_each(session, tiny_target):
    from transformers import AutoTokenizer

    cfg, s = session
    tokenizer = AutoTokenizer.from_pretrained(tiny_target)
    write = prompt_writer(s.handle, cfg, tokenizer)
    first, second = write(3), write(2)
    assert len(first) == 3 and len(second) == 2
    assert all(isinstance(text, str) and isinstance(finished, bool) for text, finished in first + second)
    assert len({text for text, _ in first + second}) == 5  # a seed per request, never reused


def test_prepare_then_online_and_offline_capture_agree_and_reruns_skip(session):
    cfg, s = session
    prepared = data_stage.run(cfg, s.handle)
    samples = prepared.all_records()
    assert sum(prepared.samples.values()) == len(samples) == len(PROMPTS) and prepared.bad_rows == {}
    assert PreparedData.read(cfg.data.output_dir) == prepared  # the artifact reads back from its files
    assert all(sum(x.loss_mask) > 0 for x in samples)

    bad = BadRows()
    online = {
        r["sample_id"]: r
        for r in iter_records(
            capture_dataset(samples, s.num_layers_captured, s.info.hidden_size, 4, 1).iter_rows(), bad
        )
    }
    assert len(samples_to_capture(cfg)[0]) == len(PROMPTS)
    cfg = with_values(cfg, {"capture.shard_size": 4})
    first = run_capture_offline(cfg, s)
    assert samples_to_capture(cfg) == ([], {x.sample_id for x in samples})  # what the demo checks before capture
    offline = {r["sample_id"]: r for r in read_offline(cfg.capture.output_dir)}
    assert first.captured == len(PROMPTS) and bad.total() == 0
    assert online.keys() == offline.keys() == {x.sample_id for x in samples}
    for sample_id, record in online.items():
        for key in ("input_ids", "loss_mask"):
            assert torch.equal(offline[sample_id][key], record[key])
        for key in ("aux_hidden", "last_hidden"):  # vLLM may batch the two runs differently: float noise only
            torch.testing.assert_close(offline[sample_id][key], record[key], atol=1e-4, rtol=1e-4)
    again = run_capture_offline(cfg, s)
    assert (again.captured, again.skipped_done) == (0, len(PROMPTS))


def test_each_rank_reads_an_equal_disjoint_share_of_a_split(tmp_path):
    def record(i):
        n = 3 + i
        return {
            "sample_id": f"s{i:02d}",
            "split": "validation" if i % 4 == 0 else "train",
            "input_ids": torch.arange(n),
            "loss_mask": torch.ones(n, dtype=torch.long),
            "aux_hidden": torch.full((n, 6), float(i)),
            "last_hidden": torch.full((n, 2), float(i)),
        }

    write_offline((record(i) for i in range(11)), tmp_path, shard_size=3)  # 4 shards, 8 train, 3 validation
    written = {r["sample_id"]: r for r in read_offline(tmp_path)}
    train = [i for i in written if written[i]["split"] == "train"]
    shares = [[r["sample_id"] for r in read_split(tmp_path, "train", rank, 3)] for rank in range(3)]
    assert shares == [train[0:6:3], train[1:6:3], train[2:6:3]]  # 8 // 3 = 2 each; the remainder is left out
    assert [r["sample_id"] for r in read_split(tmp_path, "validation")] == ["s00", "s04", "s08"]
    for r in read_split(tmp_path, "train"):
        for key in ("input_ids", "loss_mask", "aux_hidden", "last_hidden"):
            assert torch.equal(r[key], written[r["sample_id"]][key])


def test_a_failed_capture_is_one_counted_row(session):
    _, s = session
    good = TokenizedSample("good", "x", "train", list(range(10, 40)), [0] * 10 + [1] * 20)
    too_long = TokenizedSample("too-long", "x", "train", [11] * 400, [1] * 400)  # past max_model_len 256
    bad = BadRows()
    rows = capture_dataset([good, too_long], s.num_layers_captured, s.info.hidden_size, 2, 1).iter_rows()
    records = list(iter_records(rows, bad))
    assert [r["sample_id"] for r in records] == ["good"]
    assert dict(bad.counts) == {"capture_failed": 1} and bad.examples["capture_failed"] == ["too-long"]


def test_a_bad_capture_is_named(session):
    _, s = session
    ids = list(range(40, 60))
    captured = s.handle.capture_batch.remote([ids]).result()["items"][0]
    assert captured["non_finite"] == 0
    with pytest.raises(BadCapture, match="token_mismatch"):
        validate_capture(np.array(ids[::-1]), captured, s.num_layers_captured, s.info.hidden_size)
    with pytest.raises(BadCapture, match=r"bad_shape: expected \(20, 3, 96\)"):
        validate_capture(np.array(ids), captured, 3, s.info.hidden_size)
    with pytest.raises(BadCapture, match="bad_shape: expected dtype bfloat16; got float32"):
        validate_capture(np.array(ids), captured, s.num_layers_captured, s.info.hidden_size, "bfloat16")


@pytest.mark.slow  # imports vLLM (which starts a subprocess)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_replica_reads_a_connector_file_into_the_wire_format(tmp_path, dtype):
    """TargetServer's file reading alone (no engine): NaN counted, the target's dtype kept (bfloat16 as its
    bit pattern), file and lock removed; the pipeline turns it back into the same tensor."""
    from peagle_ray.capture.pipeline import as_tensor
    from peagle_ray.capture.target_server import TargetServer

    hidden = torch.randn(5, 4, 8).to(dtype)
    hidden[2, 1, 3] = float("nan")
    path = tmp_path / "req.safetensors"
    save_file({"hidden_states": hidden, "token_ids": torch.arange(5)}, str(path))
    (tmp_path / "req.safetensors.lock").touch()
    wire = TargetServer.func_or_class._read(str(path))
    assert list(tmp_path.iterdir()) == []
    assert wire["non_finite"] == 1 and wire["dtype"] == str(dtype).removeprefix("torch.")
    assert wire["hidden_states"].dtype == (np.int16 if dtype == torch.bfloat16 else np.float32)
    back = as_tensor(wire["hidden_states"], wire["dtype"])
    assert back.dtype == dtype and torch.equal(back.isnan(), hidden.isnan())
    assert torch.equal(torch.nan_to_num(back), torch.nan_to_num(hidden))
    with pytest.raises(BadCapture, match="non_finite: 1 NaN/Inf values"):
        validate_capture(np.arange(5), wire, 4, 8)
    aux, last = validate_capture(np.arange(5), {**wire, "non_finite": 0}, 4, 8)
    assert aux.shape == (5, 24) and last.shape == (5, 8) and aux.dtype == wire["hidden_states"].dtype
