"""One streamed, greedy chat completion through the ``openai`` client, timed to its first content
chunk: the request every part of the serving demo sends (``serving``, ``media``)."""

from __future__ import annotations

import time


def stream_chat(client, model: str, messages: list[dict], max_tokens: int,
                allowed_token_ids: list[int] | None = None) -> dict:
    """One streamed, greedy chat completion: its text, usage and time to the first content
    (``allowed_token_ids``: vLLM's restriction of what it samples, e.g. no special tokens)."""
    t0 = time.perf_counter()
    first = None
    parts, usage = [], None
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                            temperature=0.0, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"allowed_token_ids": allowed_token_ids}
                                            if allowed_token_ids is not None else None)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            if first is None:
                first = time.perf_counter() - t0
            parts.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
    total = time.perf_counter() - t0
    cached = 0
    if usage is not None and usage.prompt_tokens_details is not None:
        cached = usage.prompt_tokens_details.cached_tokens or 0
    return {"text": "".join(parts), "ttft_s": first if first is not None else total, "total_s": total,
            "prompt_tokens": usage.prompt_tokens if usage else 0, "cached_tokens": cached,
            "completion_tokens": usage.completion_tokens if usage else 0}
