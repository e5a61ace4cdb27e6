"""The endpoint's client side: prompts sent as an OpenAI client would (the demo's workload, `bench adapt`'s
recording)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from peagle_ray.config import PeagleConfig

if TYPE_CHECKING:
    from peagle_ray.data.public import EvalPrompt


@dataclass(frozen=True)
class Sent:
    """What send_traffic sent: requests, how many failed, seconds in all."""

    requests: int
    failed: int
    seconds: float


def send_traffic(
    cfg: PeagleConfig, url: str, model: str, prompts: list[EvalPrompt], max_tokens: int, progress=None
) -> Sent:
    """`prompts` to the endpoint at `url` one at a time, with the endpoint's default sampling and each prompt's id
    as metadata.conversation_id (adapt splits the recording by it). A failed request is counted, not raised.
    progress: a tqdm-like bar to update per request (None: silent)."""
    import openai

    api = openai.OpenAI(base_url=f"{url}/v1", api_key=cfg.serving.api_token or "none", max_retries=0, timeout=600)
    failed, started = 0, time.monotonic()
    for prompt in prompts:
        try:
            api.chat.completions.create(
                model=model,
                messages=prompt.messages,  # type: ignore[arg-type]
                max_tokens=max_tokens,
                extra_body={"metadata": {"conversation_id": prompt.prompt_id}},
            )
        except openai.OpenAIError:
            failed += 1
        if progress is not None:
            progress.update(1)
            progress.set_postfix(failed=failed)
    return Sent(len(prompts), failed, round(time.monotonic() - started, 1))
