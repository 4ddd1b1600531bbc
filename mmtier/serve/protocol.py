"""The HTTP JSON protocol of the Serve app: request parsing and typed errors (no Ray here).

``POST /v1/turn`` with ``Authorization: Bearer <key>`` (or ``X-API-Key: <key>``) and a body::

    {"conversation_id": "...",              # optional: continue a conversation
     "content": [{"type": "text", "text": "Describe "},
                 {"type": "image", "data": "<base64 PNG or JPEG>"},
                 {"type": "video", "data": "<base64 MP4>", "media_type": "video/mp4"},
                 {"type": "audio", "data": "<base64 WAV, 16-bit PCM>", "media_type": "audio/wav"}],
     "max_new_tokens": 8}                   # optional

Media types: ``image/png`` and ``image/jpeg`` for ``image`` items, ``video/mp4`` (any codec the
PyAV wheel decodes: H.264, MPEG-4 Part 2, ...) for ``video`` items, ``audio/wav`` (16-bit PCM,
mono or stereo) for ``audio`` items. A media item's ``media_type`` is optional; when given it must
be an accepted type and match the bytes. Every media item is decoded here, before the turn is
routed (``media.py``), so a bad one changes nothing anywhere.

The tenant is never read from the body: it is the tenant the API key maps to in the server's
config. A body that carries a ``tenant`` field is **rejected** (400), as is any other unknown
field, so a client that believes it can pick its tenant learns at once that it cannot.

Errors are ``{"error": {"status": N, "type": "...", "message": "..."}}`` with status 400 (malformed
JSON, bad base64, unknown content type, bad field, media bytes that do not decode:
``bad_media``), 401 (missing or unknown API key), 404 (unknown conversation), 413 (body, text
item, media item, an image's pixels, a video's seconds, frames or frame pixels, an audio clip's
seconds or the turn's tokens over the configured limit), 415 (``unsupported_media_type``: a GIF, a
WebM or QuickTime video, a float WAV, a ``media_type`` not accepted, a media kind the model does
not take), 503 (the cache has no room: ``CapacityError``; the model stayed busy: ``busy``; the
worker was lost); 500 only for a server fault, never for bad input.
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
_TOP_FIELDS = {"conversation_id", "content", "max_new_tokens"}


class HTTPError(Exception):
    """An answer with a status code and a JSON message."""

    def __init__(self, status: int, kind: str, message: str):
        super().__init__(message)
        self.status, self.kind, self.message = status, kind, message

    def body(self) -> dict:
        return {"error": {"status": self.status, "type": self.kind, "message": self.message}}


def bad(message: str, kind: str = "bad_request") -> HTTPError:
    return HTTPError(400, kind, message)


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


@dataclass(frozen=True)
class TurnRequest:
    conversation_id: str | None
    content: tuple[TextItem | MediaItem, ...]
    max_new_tokens: int

    @property
    def media(self) -> list[MediaItem]:
        return [i for i in self.content if isinstance(i, MediaItem)]


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


def parse_turn(body: bytes, limits: Limits,
               media_tokens: Callable[[MediaItem], int] | None = None) -> TurnRequest:
    """A checked turn, or ``HTTPError`` (400 / 413). Media are decoded and hashed here.

    The turn's tokens (``limits.max_turn_tokens``): UTF-8 bytes of its text (the reference model
    is byte-level), ``media_tokens(item)`` per media item (the model's encoders know; none
    counted without it) and ``max_new_tokens``."""
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
                  "to on the server", "tenant_in_body")
    unknown = sorted(set(doc) - _TOP_FIELDS)
    if unknown:
        raise bad(f"unknown fields {unknown}; a turn has {sorted(_TOP_FIELDS)}")
    conv = doc.get("conversation_id")
    if conv is not None and (not isinstance(conv, str) or not conv or len(conv) > 128):
        raise bad("conversation_id must be a non-empty string (up to 128 characters)")
    new = doc.get("max_new_tokens", limits.default_new_tokens)
    if isinstance(new, bool) or not isinstance(new, int) or not 0 <= new <= limits.max_new_tokens:
        raise bad(f"max_new_tokens must be an integer in [0, {limits.max_new_tokens}]")
    content = doc.get("content")
    if not isinstance(content, list) or not content:
        raise bad("content must be a non-empty list of items")
    if len(content) > limits.max_items:
        raise bad(f"{len(content)} content items; at most {limits.max_items}")
    items = tuple(_item(i, n, limits) for n, i in enumerate(content))
    tokens = new + sum(len(i.text.encode()) if isinstance(i, TextItem)
                       else _media_tokens(media_tokens, i, n) for n, i in enumerate(items))
    if tokens > limits.max_turn_tokens:
        raise HTTPError(413, "too_large", f"the turn is {tokens} tokens (text, media and max_new_tokens); "
                                          f"at most {limits.max_turn_tokens}")
    return TurnRequest(conv, items, new)


def _item(item: object, n: int, limits: Limits) -> TextItem | MediaItem:
    where = f"content[{n}]"
    if not isinstance(item, dict) or not isinstance(item.get("type"), str):
        raise bad(f"{where} must be an object with a 'type'")
    kind = item["type"]
    if kind == "text":
        if set(item) != {"type", "text"} or not isinstance(item["text"], str) or not item["text"]:
            raise bad(f"{where}: a text item is {{'type': 'text', 'text': <non-empty string>}}")
        text = item["text"]
        if len(text) > limits.max_text_bytes:          # each character is one byte or more
            raise HTTPError(413, "too_large", f"{where}: text of {len(text)} characters is over the "
                                              f"{limits.max_text_bytes}-byte limit")
        try:
            size = len(text.encode())
        except UnicodeEncodeError:
            raise bad(f"{where}: text is not valid Unicode (a lone surrogate)") from None
        if size > limits.max_text_bytes:
            raise HTTPError(413, "too_large", f"{where}: text of {size} bytes is over the "
                                              f"{limits.max_text_bytes}-byte limit")
        return TextItem(text)
    if kind not in MEDIA_TYPES:
        raise bad(f"{where}: unknown content type {kind!r}; use 'text', "
                  + ", ".join(repr(t) for t in MEDIA_TYPES), "unknown_media_kind")
    if not {"type", "data"} <= set(item) <= {"type", "data", "media_type"} or not isinstance(item["data"], str):
        raise bad(f"{where}: a media item is {{'type': {kind!r}, 'data': <base64 string>}} "
                  "(and optionally 'media_type')")
    declared = item.get("media_type")
    if declared is not None and declared not in ACCEPTED[kind]:
        raise HTTPError(415, "unsupported_media_type", f"{where}: media_type {declared!r} is not accepted for "
                                                       f"{kind}; use one of {list(ACCEPTED[kind])}")
    encoded = item["data"]
    if len(encoded) // 4 * 3 > limits.max_media_bytes + 3:          # before decoding anything
        raise HTTPError(413, "too_large", f"{where}: {kind} is over the {limits.max_media_bytes}-byte limit")
    try:
        data = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise bad(f"{where}: data is not valid base64 ({exc})", "bad_base64") from None
    if not data:
        raise bad(f"{where}: {kind} is empty")
    if len(data) > limits.max_media_bytes:
        raise HTTPError(413, "too_large", f"{where}: {kind} of {len(data)} bytes is over the "
                                          f"{limits.max_media_bytes}-byte limit")
    info = _decode(kind, data, limits, where)
    if declared is not None and declared != info.media_type:
        raise HTTPError(415, "unsupported_media_type", f"{where}: the bytes are {info.media_type}, "
                                                       f"not the declared {declared}")
    return MediaItem(kind, data, hashlib.sha256(data).hexdigest(), info)


def _media_tokens(count: Callable[[MediaItem], int] | None, item: MediaItem, n: int) -> int:
    """The model's tokens for a media item; a kind or item the model refuses is a 415 / 400."""
    if count is None:
        return 0
    try:
        return count(item)
    except BadMediaError as exc:
        status, kind = (415, "unsupported_media_type") if exc.unsupported else (400, "bad_media")
        raise HTTPError(status, kind, f"content[{n}]: {exc}") from None


def _decode(kind: str, data: bytes, limits: Limits, where: str) -> ImageInfo | VideoInfo | AudioInfo:
    try:
        if kind == "image":
            return check_image(data, limits.max_image_pixels)
        if kind == "video":
            return check_video(data, limits.max_video_seconds, limits.max_video_frames, limits.max_video_pixels)
        return check_wav(data, limits.max_audio_seconds)
    except TooLargeMedia as exc:
        raise HTTPError(413, "too_large", f"{where}: {exc}") from None
    except BadMediaError as exc:
        if exc.unsupported:
            raise HTTPError(415, "unsupported_media_type", f"{where}: {exc}") from None
        raise bad(f"{where}: {exc}", "bad_media") from None
