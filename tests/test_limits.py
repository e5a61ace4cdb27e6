"""The endpoint's request limits as a pure function: literal requests in, the 400 message or the forwarded
body out (the live endpoint is tested in test_serve.py)."""

import json

import pytest

from peagle_ray.serve.limits import Limits, Rejected, admit, check_request

LIMITS = Limits(
    max_prompt_tokens=10, max_tokens_limit=100, max_n=4, max_logprobs=5, max_prompts_per_request=3, max_model_len=40
)


def lengths(value, chat):
    """One token per character, as a stand-in tokenizer."""
    if chat:
        return [sum(len(m.get("content", "")) for m in value)] if isinstance(value, list) else []
    if isinstance(value, list) and all(isinstance(v, int) for v in value):
        return [len(value)]
    return [len(v) for v in value] if isinstance(value, list) else [len(value)]


@pytest.mark.parametrize(
    "request_, chat, message, param",
    [
        ({"prompt": "hi", "n": 5}, False, "n must be an integer between 1 and 4 (serving.max_n); got 5", "n"),
        ({"prompt": "hi", "n": 0}, False, "n must be an integer between 1 and 4 (serving.max_n); got 0", "n"),
        ({"prompt": "hi", "n": "2"}, False, "n must be an integer; got '2'", "n"),
        (
            {"prompt": "hi", "best_of": 9},
            False,
            "best_of must be an integer between 1 and 4 (serving.max_n); got 9",
            "best_of",
        ),
        (
            {"prompt": "hi", "logprobs": 6},
            False,
            "logprobs must be an integer between 0 and 5 (serving.max_logprobs); got 6",
            "logprobs",
        ),
        (
            {"prompt": "hi", "prompt_logprobs": -1},
            False,
            "prompt_logprobs must be an integer between 0 and 5 (serving.max_logprobs); got -1",
            "prompt_logprobs",
        ),
        (
            {"messages": [], "top_logprobs": 6},
            True,
            "top_logprobs must be an integer between 0 and 5 (serving.max_logprobs); got 6",
            "top_logprobs",
        ),
        (
            {"prompt": ["a", "b", "c", "d"]},
            False,
            "prompt holds 4 prompts; the limit is 3 (serving.max_prompts_per_request)",
            "prompt",
        ),
        ({"prompt": "x" * 11}, False, "prompt is 11 tokens; the limit is 10 (serving.max_prompt_tokens)", "prompt"),
        (
            {"prompt": "hi", "max_tokens": 101},
            False,
            "max_tokens must be an integer between 1 and 100 (serving.max_tokens_limit); got 101",
            "max_tokens",
        ),
        (
            {"prompt": "hi", "n": 3, "max_tokens": 40},
            False,
            "max_tokens x n x prompts = 40 x 3 x 1 = 120 tokens; the limit is 100 per request (serving.max_tokens_limit)",
            "max_tokens",
        ),
        (
            {"prompt": ["a", "b"], "n": 2, "best_of": 3, "max_completion_tokens": 20},
            False,
            "max_completion_tokens x n x prompts = 20 x 3 x 2 = 120 tokens",
            "max_completion_tokens",
        ),
        (
            {"messages": [{"role": "user", "content": "hi"}, {"role": "nobody", "content": "x"}]},
            True,
            "messages[1].role must be one of system, developer, user, assistant, tool, function; got 'nobody'",
            "messages[1].role",
        ),
        ({"messages": [{"content": "no role"}]}, True, "messages[0].role must be one of", "messages[0].role"),
        ({"messages": ["not an object"]}, True, "got None", "messages[0].role"),
    ],
)
def test_each_limit_names_the_field_the_limit_and_the_value(request_, chat, message, param):
    with pytest.raises(Rejected) as err:
        check_request(request_, chat, LIMITS, lengths)
    assert message in str(err.value) and err.value.param == param


def test_requests_within_the_limits_pass_and_a_missing_max_tokens_is_bounded():
    assert check_request({"prompt": "hi", "n": 4, "max_tokens": 25}, False, LIMITS, lengths) == {}
    assert check_request({"prompt": [1, 2, 3], "max_tokens": 100}, False, LIMITS, lengths) == {}  # token ids: 1 prompt
    assert check_request({"prompt": ["a", "b"], "n": 2}, False, LIMITS, lengths) == {"max_tokens": 25}
    assert check_request({"prompt": "x" * 10}, False, LIMITS, lengths) == {"max_tokens": 30}  # 40 - 10 fits
    chat = {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}], "logprobs": True}
    assert check_request(chat, True, LIMITS, lengths) == {"max_tokens": 37}


def test_admit_returns_an_openai_error_or_the_forwarded_body():
    problem, body = admit(b'{"prompt": "hi", "n": 9}', False, LIMITS, lengths)
    assert problem[0] == 400 and json.loads(problem[1])["error"] == {
        "message": "n must be an integer between 1 and 4 (serving.max_n); got 9",
        "type": "BadRequestError",
        "param": "n",
        "code": 400,
    }
    assert admit(b'{"prompt": "hi", "max_tokens": 3}', False, LIMITS, lengths) == (
        None,
        b'{"prompt": "hi", "max_tokens": 3}',
    )
    assert json.loads(admit(b'{"prompt": "hi"}', False, LIMITS, lengths)[1]) == {"prompt": "hi", "max_tokens": 38}
    assert admit(b"[1]", False, LIMITS, lengths)[0][0] == 400 and admit(b"{bad", False, LIMITS, lengths)[0][0] == 400
