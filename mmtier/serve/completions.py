"""What the Serve app answers: OpenAI ``chat.completion`` bodies and their SSE stream (no Ray).

``completion(...)`` is the JSON body of a non-streamed answer; ``chunks(...)`` the ``data: ...``
lines of a streamed one (``stream: true``): a first chunk with the assistant's role, one chunk
per answer token that completes at least one character (the byte-level vocabulary: a character
of several bytes is sent with its last byte), a last chunk with the ``finish_reason``, a chunk
with ``usage`` when ``stream_options.include_usage`` asked for it, then ``data: [DONE]``. The
stream's text, joined, is the non-streamed answer's. ``usage.prompt_tokens_details.cached_tokens``
counts the prompt tokens attached from mmtier's cache (the conversation's history and media found
by key, wherever they were held) rather than run through the model.

mmtier's own figures ride along under ``mmtier`` (an extra field; the ``openai`` client keeps it
in ``model_extra``): the answer's token ids, the node and worker, the routing rule and the
cache counters of this request.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Iterator

from ..chat.media import BYTE0, ESCAPE0


def completion_id() -> str:
    return f"chatcmpl-{secrets.token_hex(12)}"


def usage(answer: dict) -> dict:
    out = {"prompt_tokens": answer["prompt_tokens"], "completion_tokens": len(answer["tokens"]),
           "total_tokens": answer["prompt_tokens"] + len(answer["tokens"])}
    if answer.get("cached_tokens") is not None:
        out["prompt_tokens_details"] = {"cached_tokens": answer["cached_tokens"]}
    return out


def finish_reason(answer: dict, max_new_tokens: int) -> str:
    return "length" if len(answer["tokens"]) >= max_new_tokens else "stop"


def completion(cid: str, model: str, answer: dict, max_new_tokens: int, extra: dict) -> dict:
    return {"id": cid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": answer["text"]},
                         "logprobs": None, "finish_reason": finish_reason(answer, max_new_tokens)}],
            "usage": usage(answer), "mmtier": extra}


def pieces(text: str, tokens: list[int]) -> list[str]:
    """``text`` cut at the tokens where its characters end (one byte a token: a character of
    several UTF-8 bytes ends at its last byte's token); ``"".join`` gives ``text`` back."""
    if not all(BYTE0 <= t < BYTE0 + 256 for t in tokens):
        return [text] if text else []
    ends: dict[int, str] = {}
    at = 0
    for c in text:
        at += 1 if ESCAPE0 <= ord(c) <= ESCAPE0 + 0xFF else len(c.encode())
        ends[at] = ends.get(at, "") + c
    return [ends[i] for i in sorted(ends)]


def chunks(cid: str, model: str, answer: dict, max_new_tokens: int, include_usage: bool,
           extra: dict) -> Iterator[bytes]:
    created = int(time.time())

    def event(choices: list, **more) -> bytes:
        body = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": choices, **more}
        if include_usage and "usage" not in body:
            body["usage"] = None
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n".encode()

    yield event([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                  "finish_reason": None}])
    for piece in pieces(answer["text"], answer["tokens"]):
        yield event([{"index": 0, "delta": {"content": piece}, "logprobs": None, "finish_reason": None}])
    yield event([{"index": 0, "delta": {}, "logprobs": None,
                  "finish_reason": finish_reason(answer, max_new_tokens)}], mmtier=extra)
    if include_usage:
        yield event([], usage=usage(answer))
    yield b"data: [DONE]\n\n"
