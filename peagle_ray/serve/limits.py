"""Request limits of the REST endpoint, checked before vLLM sees a request (pure: no Ray, no vLLM).

One request may not occupy the server: every field that multiplies the work is bounded, and a violation is
an HTTP 400 in OpenAI's error shape naming the field, the limit and the value, e.g.
    {"prompt": "hi", "n": 1000}  ->  400 "n must be an integer between 1 and 8; got 1000" (param "n")

    copies  = max(n, best_of)                       completions generated per prompt
    prompts = 1, or the length of a list-valued `prompt` (at most serving.max_prompts_per_request)
    total   = prompts x copies x max_tokens         at most serving.max_tokens_limit

A request without `max_tokens` / `max_completion_tokens` gets max_tokens = serving.max_tokens_limit //
(prompts x copies), shortened to what fits the context after the longest prompt, so the total holds for it
too (vLLM's own default would be the whole remaining context).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

TOKEN_FIELDS = ("max_tokens", "max_completion_tokens")
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")  # OpenAI's chat roles


@dataclass(frozen=True)
class Limits:
    max_prompt_tokens: int  # serving.max_prompt_tokens
    max_tokens_limit: int  # serving.max_tokens_limit: prompts x copies x max_tokens
    max_n: int  # serving.max_n: n and best_of
    max_logprobs: int  # serving.max_logprobs: logprobs, top_logprobs, prompt_logprobs
    max_prompts_per_request: int  # serving.max_prompts_per_request: a list-valued `prompt`
    max_model_len: int  # target.max_model_len: where an injected max_tokens must still fit


class Rejected(Exception):
    """A request over a limit: `param` names the field (OpenAI's error.param)."""

    def __init__(self, message: str, param: str | None):
        super().__init__(message)
        self.param = param


def openai_error(message: str, param: str | None, status: int = 400) -> tuple[int, bytes]:
    body = {"error": {"message": message, "type": "BadRequestError", "param": param, "code": status}}
    return status, json.dumps(body).encode()


def admit(body: bytes, chat: bool, limits: Limits, prompt_lengths) -> tuple[tuple[int, bytes] | None, bytes]:
    """(None, the body to forward) for a request within the limits, else ((400, OpenAI error), body).

    prompt_lengths(value, chat) -> token counts of the prompt(s), [] when it cannot tell (vLLM's own
    validation then answers the malformed prompt)."""
    try:
        request = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        return openai_error(f"request body is not valid JSON: {err}", None), body
    if not isinstance(request, dict):
        return openai_error(f"request body must be a JSON object; got {type(request).__name__}", None), body
    try:
        added = check_request(request, chat, limits, prompt_lengths)
    except Rejected as err:
        return openai_error(str(err), err.param), body
    return None, json.dumps({**request, **added}).encode() if added else body


def check_request(request: dict, chat: bool, limits: Limits, prompt_lengths) -> dict:
    """Raise Rejected for the first field over its limit; return the fields to add (an injected max_tokens)."""
    copies = max(
        _bounded(request, "n", 1, limits.max_n, "serving.max_n"),
        _bounded(request, "best_of", 1, limits.max_n, "serving.max_n"),
    )
    for name in ("top_logprobs", "prompt_logprobs") + (() if chat else ("logprobs",)):
        _bounded(request, name, 0, limits.max_logprobs, "serving.max_logprobs")
    if chat:
        _check_roles(request.get("messages"))
    field = "messages" if chat else "prompt"
    value = request.get(field)
    prompts = _prompt_count(value, chat)
    if prompts > limits.max_prompts_per_request:
        raise Rejected(
            f"prompt holds {prompts} prompts; the limit is {limits.max_prompts_per_request} "
            f"(serving.max_prompts_per_request)",
            "prompt",
        )
    lengths = prompt_lengths(value, chat)
    if lengths and max(lengths) > limits.max_prompt_tokens:
        raise Rejected(
            f"{field} is {max(lengths)} tokens; the limit is {limits.max_prompt_tokens} (serving.max_prompt_tokens)",
            field,
        )
    streams = prompts * copies
    asked = [
        (name, _bounded(request, name, 1, limits.max_tokens_limit, "serving.max_tokens_limit"))
        for name in TOKEN_FIELDS
        if request.get(name) is not None
    ]
    for name, tokens in asked:
        if tokens * streams > limits.max_tokens_limit:
            raise Rejected(
                f"{name} x n x prompts = {tokens} x {copies} x {prompts} = {tokens * streams} tokens; "
                f"the limit is {limits.max_tokens_limit} per request (serving.max_tokens_limit)",
                name,
            )
    if asked:
        return {}
    room = limits.max_model_len - max(lengths, default=0)
    return {"max_tokens": max(1, min(limits.max_tokens_limit // streams, room))}


def _bounded(request: dict, name: str, low: int, high: int, setting: str) -> int:
    """The integer value of `name` (low when absent or null), refused outside low..high."""
    value = request.get(name)
    if value is None:
        return low
    if isinstance(value, bool) or not isinstance(value, int):
        raise Rejected(f"{name} must be an integer; got {value!r}", name)
    if not low <= value <= high:
        raise Rejected(f"{name} must be an integer between {low} and {high} ({setting}); got {value}", name)
    return value


def _check_roles(messages: object) -> None:
    if not isinstance(messages, list):
        return  # vLLM's validation names a malformed `messages`
    for i, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        if not isinstance(role, str) or role not in CHAT_ROLES:
            raise Rejected(
                f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}; got {role!r}", f"messages[{i}].role"
            )


def _prompt_count(value: object, chat: bool) -> int:
    """How many prompts one request carries: a list of strings or of token lists is a batch."""
    if chat or not isinstance(value, list) or not value:
        return 1
    return 1 if all(isinstance(v, int) for v in value) else len(value)
