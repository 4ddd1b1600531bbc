"""The OpenAI chat completions request of the Serve app: parsing and typed errors (no Ray here).

``POST /v1/chat/completions`` with ``Authorization: Bearer <key>`` (or ``X-API-Key: <key>``) and
an OpenAI body, stateless: ``messages`` carries the whole conversation::

    {"model": "mmtier-chat",
     "messages": [
       {"role": "system", "content": "Be brief."},                   # optional, first
       {"role": "user", "content": [
          {"type": "text", "text": "Describe "},
          {"type": "image_url", "image_url": {"url": "data:image/png;base64,<...>"}},
          {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,<...>"}},
          {"type": "input_audio", "input_audio": {"data": "<base64 WAV>", "format": "wav"}}]},
       {"role": "assistant", "content": "<the answer it got>"},      # earlier turns, as answered
       {"role": "user", "content": "and then?"}],                    # the turn to answer
     "max_tokens": 8,                        # or max_completion_tokens; default limits.default_new_tokens
     "stream": false, "stream_options": {"include_usage": true}}

A user message's content is a string or a list of parts; consecutive user messages are one
turn; a system (or developer) message's text opens the first turn. Media come as data URLs
(the server fetches nothing): ``image/png`` and ``image/jpeg`` for ``image_url``, ``video/mp4``
(any codec the PyAV wheel decodes: H.264, MPEG-4 Part 2, ...) for ``video_url``, WAV (16-bit
PCM, mono or stereo) for ``input_audio``. The data URL's type (``format`` for audio) must be an
accepted one and match the bytes. Every media item, the history's included, is decoded here,
before the request is routed (``media.py``), so a bad one changes nothing anywhere. Decoding is
greedy: ``temperature`` 0 and ``top_p`` 1 (or absent), ``n`` 1; other sampling fields are
refused by name.

The tenant is never read from the body: it is the tenant the API key maps to in the server's
config. A body that carries a ``tenant`` field is **rejected** (400), as is any other unknown
field, so a client that believes it can pick its tenant learns at once that it cannot.

Errors are OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, ``code`` naming
the case: 400 (``malformed_json``, ``bad_base64``, ``bad_media`` for bytes that do not decode,
``unknown_content_type``, ``tenant_in_body``, ``bad_request``), 401 (``invalid_api_key``), 404
(``model_not_found``, ``not_found``), 413 (``too_large``: body, text part, media item, an image's
pixels, a video's seconds, frames or frame pixels, a clip's seconds, the request's tokens), 415
(``unsupported_media_type``: a GIF, a WebM or QuickTime video, a float WAV, a data URL type not
accepted, a media kind the model does not take), 503 (``capacity``: the cache has no room;
``busy``: the model stayed busy; ``worker_lost``; ``timeout``); 500 only for a server fault, never
for bad input.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import BadMediaError
from .config import Limits
from .media import (
    ACCEPTED,
    AudioInfo,
    ImageInfo,
    TooLargeMedia,
    VideoInfo,
    check_image,
    check_video,
    check_wav,
)

MEDIA_TYPES = {"image": "vision", "video": "video", "audio": "audio"}      # request type -> model modality
TYPE_OF = {v: k for k, v in MEDIA_TYPES.items()}
PARTS = {"image_url": "image", "video_url": "video", "input_audio": "audio"}   # OpenAI part -> kind
AUDIO_FORMATS = {"wav": "audio/wav"}
_FIELDS = {"model", "messages", "max_tokens", "max_completion_tokens", "stream", "stream_options",
           "temperature", "top_p", "n", "user", "seed"}
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error", 415: "invalid_request_error",
          500: "server_error", 503: "service_unavailable_error"}


class HTTPError(Exception):
    """An answer with a status code and an OpenAI-shaped JSON error."""

    def __init__(self, status: int, code: str, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.code, self.message, self.param = status, code, message, param

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": _TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}


def bad(message: str, code: str = "bad_request", param: str | None = None) -> HTTPError:
    return HTTPError(400, code, message, param)


@dataclass(frozen=True)
class MediaItem:
    type: str                 # "image" | "video" | "audio"
    data: bytes
    sha256: str               # computed here, on the server
    info: ImageInfo | VideoInfo | AudioInfo    # what the bytes decoded to (media type, size)

    @property
    def modality(self) -> str:
        return MEDIA_TYPES[self.type]


@dataclass(frozen=True)
class TextItem:
    text: str


Content = tuple[TextItem | MediaItem, ...]


@dataclass(frozen=True)
class ChatRequest:
    model: str
    history: tuple[tuple[Content, str], ...]   # earlier turns: (user content, the answer's text)
    content: Content                           # the turn to answer
    max_new_tokens: int
    stream: bool = False
    include_usage: bool = False

    @property
    def media(self) -> list[MediaItem]:
        """Every media item of the request, the history's first, in order."""
        every = [i for turn, _a in self.history for i in turn] + list(self.content)
        return [i for i in every if isinstance(i, MediaItem)]


def api_key(headers) -> str | None:
    """The API key of a request: ``Authorization: Bearer <key>``, else ``X-API-Key``."""
    auth = headers.get("authorization")
    if auth:
        scheme, _, value = auth.partition(" ")
        if scheme.lower() == "bearer" and value.strip():
            return value.strip()
        return None
    key = headers.get("x-api-key")
    return key.strip() if key and key.strip() else None


def parse_chat(body: bytes, limits: Limits, model: str,
               media_tokens: Callable[[MediaItem], int] | None = None) -> ChatRequest:
    """A checked request, or ``HTTPError`` (400 / 404 / 413 / 415). Media are decoded and hashed
    here.

    The request's tokens (``limits.max_request_tokens``): UTF-8 bytes of its text (earlier answers
    included; the vocabularies are byte-level), ``media_tokens(item)`` per media item (the model's
    encoders know; none counted without it) and ``max_tokens``."""
    if len(body) > limits.max_request_bytes:
        raise HTTPError(413, "too_large", f"request body of {len(body)} bytes is over the "
                                          f"{limits.max_request_bytes}-byte limit")
    try:
        doc = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise bad(f"malformed JSON: {exc}", "malformed_json") from None
    if not isinstance(doc, dict):
        raise bad("the body must be a JSON object", "malformed_json")
    if "tenant" in doc:
        raise bad("'tenant' is not accepted in the body: the tenant is the one your API key maps "
                  "to on the server", "tenant_in_body", "tenant")
    unknown = sorted(set(doc) - _FIELDS)
    if unknown:
        raise bad(f"unknown or unsupported fields {unknown}; this server takes {sorted(_FIELDS)}",
                  param=unknown[0])
    name = doc.get("model")
    if not isinstance(name, str) or not name:
        raise bad("model must be the name of a served model (GET /v1/models)", param="model")
    if name != model:
        raise HTTPError(404, "model_not_found", f"the model {name!r} is not served here; it serves {model!r}",
                        "model")
    _greedy(doc)
    new = _max_tokens(doc, limits)
    stream = doc.get("stream", False)
    if stream is not None and not isinstance(stream, bool):
        raise bad("stream must be true or false", param="stream")
    options = doc.get("stream_options")
    if options is not None and (not stream or not isinstance(options, dict) or set(options) - {"include_usage"}
                                or not isinstance(options.get("include_usage", False), bool)):
        raise bad("stream_options is {'include_usage': bool}, with stream: true", param="stream_options")
    history, content = _turns(doc.get("messages"), limits)
    items = [i for turn, _a in history for i in turn] + list(content)
    tokens = new + sum(len(a.encode()) for _t, a in history) + sum(
        len(i.text.encode()) if isinstance(i, TextItem) else _media_tokens(media_tokens, i) for i in items)
    if tokens > limits.max_request_tokens:
        raise HTTPError(413, "too_large", f"the request is {tokens} tokens (text, media, earlier answers and "
                                          f"max_tokens); at most {limits.max_request_tokens}", "messages")
    return ChatRequest(name, tuple(history), content, new, bool(stream), bool((options or {}).get("include_usage")))


def _greedy(doc: dict) -> None:
    for field, ok in (("temperature", 0), ("top_p", 1), ("n", 1)):
        value = doc.get(field)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float) or value != ok):
            raise bad(f"{field} must be {ok} (or absent): this server decodes greedily", param=field)


def _max_tokens(doc: dict, limits: Limits) -> int:
    if doc.get("max_tokens") is not None and doc.get("max_completion_tokens") is not None:
        raise bad("give max_tokens or max_completion_tokens, not both", param="max_tokens")
    field = "max_completion_tokens" if doc.get("max_completion_tokens") is not None else "max_tokens"
    new = doc.get(field)
    if new is None:
        return limits.default_new_tokens
    if isinstance(new, bool) or not isinstance(new, int) or not 1 <= new <= limits.max_new_tokens:
        raise bad(f"{field} must be an integer in [1, {limits.max_new_tokens}]", param=field)
    return new


def _turns(messages: object, limits: Limits) -> tuple[list[tuple[Content, str]], Content]:
    """``(earlier turns, the turn to answer)`` of ``messages``."""
    if not isinstance(messages, list) or not messages:
        raise bad("messages must be a non-empty list", param="messages")
    turns: list[tuple[list, str | None]] = []
    opening: list[TextItem] = []
    count = 0
    for n, m in enumerate(messages):
        where = f"messages[{n}]"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad(f"{where} must be an object with a 'role'", param=where)
        role = m["role"]
        unknown = sorted(set(m) - {"role", "content", "name"})
        if unknown:
            raise bad(f"{where}: unsupported fields {unknown}", param=f"{where}.{unknown[0]}")
        if role in ("system", "developer"):
            if turns:
                raise bad(f"{where}: a {role} message comes before the conversation's first user message",
                          param=where)
            opening += _text_parts(m.get("content"), where, limits)
        elif role == "user":
            parts = _user_parts(m.get("content"), where, limits)
            count += len(parts)
            if count > limits.max_items:
                raise bad(f"more than {limits.max_items} content parts in the request", param="messages")
            if turns and turns[-1][1] is None:
                turns[-1][0].extend(parts)                  # consecutive user messages: one turn
            else:
                turns.append(([*opening, *parts] if not turns else parts, None))
        elif role == "assistant":
            if not turns or turns[-1][1] is not None:
                raise bad(f"{where}: an assistant message answers a user message", param=where)
            answer = "".join(t.text for t in _text_parts(m.get("content"), where, limits))
            if not answer:
                raise bad(f"{where}: an assistant message of no text", param=f"{where}.content")
            turns[-1] = (turns[-1][0], answer)
        else:
            raise bad(f"{where}: role {role!r} is not supported; use system, user, assistant", param=where)
    if not turns or turns[-1][1] is not None:
        raise bad("the last message must be a user message (the turn to answer)", param="messages")
    history = [(tuple(items), answer) for items, answer in turns[:-1]]
    return history, tuple(turns[-1][0])


def _text_parts(content: object, where: str, limits: Limits) -> list[TextItem]:
    if isinstance(content, str):
        return [_text(content, f"{where}.content", limits)] if content else []
    if not isinstance(content, list):
        raise bad(f"{where}: content must be a string or a list of text parts", param=f"{where}.content")
    out = []
    for k, part in enumerate(content):
        at = f"{where}.content[{k}]"
        if not isinstance(part, dict) or part.get("type") != "text":
            raise bad(f"{at}: this message takes text parts only", "unknown_content_type", at)
        out.append(_text_part(part, at, limits))
    return out


def _user_parts(content: object, where: str, limits: Limits) -> list[TextItem | MediaItem]:
    if isinstance(content, str):
        if not content:
            raise bad(f"{where}: content is empty", param=f"{where}.content")
        return [_text(content, f"{where}.content", limits)]
    if not isinstance(content, list) or not content:
        raise bad(f"{where}: content must be a string or a non-empty list of parts", param=f"{where}.content")
    out: list[TextItem | MediaItem] = []
    for k, part in enumerate(content):
        at = f"{where}.content[{k}]"
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise bad(f"{at} must be an object with a 'type'", param=at)
        kind = part["type"]
        if kind == "text":
            out.append(_text_part(part, at, limits))
        elif kind in PARTS:
            out.append(_media_part(part, at, limits))
        else:
            raise bad(f"{at}: unknown content part type {kind!r}; use 'text', "
                      + ", ".join(repr(t) for t in PARTS), "unknown_content_type", at)
    return out


def _text_part(part: dict, at: str, limits: Limits) -> TextItem:
    if set(part) != {"type", "text"} or not isinstance(part["text"], str) or not part["text"]:
        raise bad(f"{at}: a text part is {{'type': 'text', 'text': <non-empty string>}}", param=at)
    return _text(part["text"], at, limits)


def _text(text: str, at: str, limits: Limits) -> TextItem:
    if len(text) > limits.max_text_bytes:          # each character is one byte or more
        raise HTTPError(413, "too_large", f"{at}: text of {len(text)} characters is over the "
                                          f"{limits.max_text_bytes}-byte limit", at)
    try:
        size = len(text.encode())
    except UnicodeEncodeError:
        raise bad(f"{at}: text is not valid Unicode (a lone surrogate)", param=at) from None
    if size > limits.max_text_bytes:
        raise HTTPError(413, "too_large", f"{at}: text of {size} bytes is over the "
                                          f"{limits.max_text_bytes}-byte limit", at)
    return TextItem(text)


def _media_part(part: dict, at: str, limits: Limits) -> MediaItem:
    field = part["type"]
    kind = PARTS[field]
    inner = part.get(field)
    if set(part) != {"type", field} or not isinstance(inner, dict):
        raise bad(f"{at}: a {field} part is {{'type': {field!r}, {field!r}: {{...}}}}", param=at)
    if kind == "audio":
        if set(inner) != {"data", "format"} or not isinstance(inner["data"], str):
            raise bad(f"{at}: input_audio is {{'data': <base64>, 'format': 'wav'}}", param=at)
        declared = AUDIO_FORMATS.get(inner["format"]) if isinstance(inner["format"], str) else None
        if declared is None:
            raise HTTPError(415, "unsupported_media_type", f"{at}: audio format {inner['format']!r} is not "
                                                           f"accepted; use {sorted(AUDIO_FORMATS)}", at)
        encoded = inner["data"]
    else:
        url = inner.get("url")
        if not set(inner) <= {"url", "detail"} or not isinstance(url, str):
            raise bad(f"{at}: {field} is {{'url': 'data:<type>;base64,<data>'}}", param=at)
        declared, encoded = _data_url(url, kind, at)
    return _media(kind, declared, encoded, at, limits)


def _data_url(url: str, kind: str, at: str) -> tuple[str, str]:
    if not url.startswith("data:"):
        raise bad(f"{at}: only data URLs are accepted (data:<type>;base64,...); this server fetches "
                  "nothing", "unsupported_url", at)
    head, sep, encoded = url[5:].partition(",")
    declared, _, encoding = head.partition(";")
    if not sep or encoding != "base64":
        raise bad(f"{at}: a data URL is data:<type>;base64,<data>", "bad_base64", at)
    if declared not in ACCEPTED[kind]:
        raise HTTPError(415, "unsupported_media_type", f"{at}: {declared or 'no type'} is not accepted for "
                                                       f"{kind}; use one of {list(ACCEPTED[kind])}", at)
    return declared, encoded


def _media(kind: str, declared: str, encoded: str, at: str, limits: Limits) -> MediaItem:
    if len(encoded) // 4 * 3 > limits.max_media_bytes + 3:          # before decoding anything
        raise HTTPError(413, "too_large", f"{at}: {kind} is over the {limits.max_media_bytes}-byte limit", at)
    try:
        data = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise bad(f"{at}: data is not valid base64 ({exc})", "bad_base64", at) from None
    if not data:
        raise bad(f"{at}: {kind} is empty", param=at)
    if len(data) > limits.max_media_bytes:
        raise HTTPError(413, "too_large", f"{at}: {kind} of {len(data)} bytes is over the "
                                          f"{limits.max_media_bytes}-byte limit", at)
    info = _decode(kind, data, limits, at)
    if declared != info.media_type:
        raise HTTPError(415, "unsupported_media_type", f"{at}: the bytes are {info.media_type}, "
                                                       f"not the declared {declared}", at)
    return MediaItem(kind, data, hashlib.sha256(data).hexdigest(), info)


def _media_tokens(count: Callable[[MediaItem], int] | None, item: MediaItem) -> int:
    """The model's tokens for a media item; a kind or item the model refuses is a 415 / 400."""
    if count is None:
        return 0
    try:
        return count(item)
    except BadMediaError as exc:
        status, code = (415, "unsupported_media_type") if exc.unsupported else (400, "bad_media")
        raise HTTPError(status, code, f"{item.type} ({item.sha256[:12]}): {exc}", "messages") from None


def _decode(kind: str, data: bytes, limits: Limits, at: str) -> ImageInfo | VideoInfo | AudioInfo:
    try:
        if kind == "image":
            return check_image(data, limits.max_image_pixels)
        if kind == "video":
            return check_video(data, limits.max_video_seconds, limits.max_video_frames, limits.max_video_pixels)
        return check_wav(data, limits.max_audio_seconds)
    except TooLargeMedia as exc:
        raise HTTPError(413, "too_large", f"{at}: {exc}", at) from None
    except BadMediaError as exc:
        if exc.unsupported:
            raise HTTPError(415, "unsupported_media_type", f"{at}: {exc}", at) from None
        raise bad(f"{at}: {exc}", "bad_media", at) from None
