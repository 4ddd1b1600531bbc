"""What mmtier's OpenAI ingress checks in a request body before it reaches vLLM, and the
OpenAI-shaped errors it answers with: ``{"error": {"message", "type", "param", "code"}}``.

- the body is a JSON object of at most ``max_body_bytes``;
- a client never sends ``cache_salt`` (the server sets it from the caller's tenant), and each
  media part's ``uuid`` (vLLM's name for the item) is the server's: an HMAC of the part under
  the tenant's salt (``tenant_media_ids``; a client's own is replaced), so vLLM's own encoder
  and processor caches, keyed by that name, are per tenant too;
- media in chat messages: ``image_url`` only as a ``data:`` URL of ``image/png`` or
  ``image/jpeg``, base64, whose bytes are the type it declares and decode in full
  (``serve.media.check_image``; a remote URL is refused: the server fetches nothing);
  ``input_audio`` (base64 WAV or MP3, ``serve.media.check_wav`` / ``check_mp3``) and ``video_url``
  (a ``data:video/mp4`` base64 URL whose every frame decodes, within the video limits:
  ``serve.media.check_video``) only for a model that takes that modality, else a 400 that says
  which inputs it takes; ``audio_url`` is refused (send ``input_audio``), and so is a part
  without a ``type`` (vLLM would take ``{"video_url": ...}`` as a video by its key, past these checks).

Everything here is pure (no Ray, no vLLM): ``RequestError`` carries the status and the four
fields; the ingress turns it into the response."""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import re
from dataclasses import dataclass
from typing import Any

from ..errors import BadMediaError
from .media import VIDEO_TYPES, TooLargeMedia, check_image, check_mp3, check_video, check_wav

DATA_URL = re.compile(r"data:(?P<type>[\w.+-]+/[\w.+-]+)(?P<params>(?:;[^;,]*)*),(?P<data>.*)", re.DOTALL)
IMAGE_TYPES = ("image/png", "image/jpeg")
# chat content part type -> the modality it carries (other part types go to vLLM as they are)
PART_MODALITY = {"image_url": "image", "input_audio": "audio", "audio_url": "audio", "video_url": "video"}


@dataclass(frozen=True)
class RequestLimits:
    max_body_bytes: int = 32 << 20
    max_image_pixels: int = 4096 * 4096
    max_audio_seconds: float = 600.0
    max_video_seconds: float = 60.0
    max_video_frames: int = 1800
    max_video_pixels: int = 1920 * 1080


class RequestError(Exception):
    """A request refused before it reaches the engine, with OpenAI's error fields."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def parse_body(raw: bytes, limits: RequestLimits) -> dict[str, Any]:
    """The request's JSON object."""
    if len(raw) > limits.max_body_bytes:
        raise RequestError(413, f"the request body is {len(raw)} bytes, over the {limits.max_body_bytes}-byte limit",
                           code="request_too_large")
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise RequestError(400, f"the request body is not valid JSON ({exc})", code="invalid_json") from None
    if not isinstance(body, dict):
        raise RequestError(400, f"the request body must be a JSON object, not {type(body).__name__}",
                           code="invalid_json")
    return body


def refuse_client_salt(body: dict[str, Any]) -> None:
    if "cache_salt" in body:
        raise RequestError(400, "cache_salt is set by the server from your API key's tenant; do not send it",
                           param="cache_salt", code="unsupported_parameter")


def tenant_media_ids(body: dict[str, Any], salt: str) -> None:
    """Set each media part's ``uuid`` to an HMAC-SHA256 of its type and payload under the
    tenant's ``cache_salt``. vLLM names an item by its ``uuid`` where one is given, else by a
    hash of its content alone, and its in-engine encoder cache answers any request with that
    name whatever its ``cache_salt``: under this name the same item of two tenants is two items
    (and of one tenant still one). Parts are those ``check_messages`` passed."""
    for message in body.get("messages") or []:
        content = message.get("content") if isinstance(message, dict) else None
        for part in content if isinstance(content, list) else []:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in PART_MODALITY:
                payload = json.dumps(part.get(kind), sort_keys=True, separators=(",", ":"))
                part["uuid"] = "mmtier-" + hmac.new(salt.encode(), f"{kind}\x00{payload}".encode(),
                                                    hashlib.sha256).hexdigest()


def check_messages(body: dict[str, Any], model: str, accepts: frozenset[str], limits: RequestLimits) -> None:
    """Every media part of a chat request's messages (other fields are vLLM's to check)."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return                            # the request model reports it (missing / wrong type)
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            if isinstance(part, dict):
                check_part(part, f"messages[{i}].content[{j}]", model, accepts, limits)


def check_part(part: dict[str, Any], where: str, model: str, accepts: frozenset[str],
               limits: RequestLimits) -> None:
    kind = part.get("type")
    if not isinstance(kind, str):          # vLLM would read a media part by its keys, unchecked
        raise RequestError(400, "a content part needs its type (text, image_url, input_audio, video_url)",
                           param=f"{where}.type", code="missing_required_parameter")
    modality = PART_MODALITY.get(kind)
    if modality is None:
        return
    if modality not in accepts:
        takes = ", ".join(["text", *sorted(accepts)])
        raise RequestError(400, f"model {model!r} takes no {modality} input ({kind}); it takes: {takes} "
                                "(the server's ingress_extra_kwargs.media)", param=where, code="unsupported_modality")
    if kind == "image_url":
        check_image_url(part.get("image_url"), f"{where}.image_url", limits)
    elif kind == "input_audio":
        check_input_audio(part.get("input_audio"), f"{where}.input_audio", limits)
    elif kind == "video_url":
        check_video_url(part.get("video_url"), f"{where}.video_url", limits)
    else:                                 # audio_url: remote or data URLs
        raise RequestError(400, f"{kind} is not accepted here; send audio as input_audio (base64 WAV or MP3)",
                           param=where, code="unsupported_parameter")


def check_image_url(value: Any, where: str, limits: RequestLimits) -> None:
    """A ``data:image/png`` or ``data:image/jpeg`` base64 URL whose bytes are that image."""
    url = value.get("url") if isinstance(value, dict) else None
    if not isinstance(url, str):
        raise RequestError(400, "image_url needs a url (a data: URL of a PNG or JPEG image)",
                           param=f"{where}.url", code="invalid_image_url")
    media_type, data = decode_data_url(url, f"{where}.url")
    if media_type not in IMAGE_TYPES:
        raise RequestError(400, f"image_url is {media_type}; send image/png or image/jpeg",
                           param=f"{where}.url", code="invalid_image_format")
    try:
        info = check_image(data, limits.max_image_pixels)
    except TooLargeMedia as exc:
        raise RequestError(400, str(exc), param=f"{where}.url", code="image_too_large") from None
    except BadMediaError as exc:
        code = "invalid_image_format" if exc.unsupported else "invalid_image"
        raise RequestError(400, f"image_url: {exc}", param=f"{where}.url", code=code) from None
    if info.media_type != media_type:
        raise RequestError(400, f"image_url declares {media_type} but holds {info.media_type}",
                           param=f"{where}.url", code="invalid_image_format")


def check_input_audio(value: Any, where: str, limits: RequestLimits) -> None:
    """``{"data": base64 WAV or MP3, "format": "wav" | "mp3"}``: the bytes are that format and
    no longer than the limit."""
    if not isinstance(value, dict) or not isinstance(value.get("data"), str):
        raise RequestError(400, "input_audio needs data (base64) and format", param=where,
                           code="invalid_value")
    check = AUDIO_CHECKS.get(value.get("format"))
    if check is None:
        raise RequestError(400, f"input_audio format {value.get('format')!r} is not accepted; send wav (16-bit "
                                "PCM) or mp3", param=f"{where}.format", code="invalid_value")
    data = b64decode(value["data"], f"{where}.data")
    try:
        check(data, limits.max_audio_seconds)
    except TooLargeMedia as exc:
        raise RequestError(400, f"input_audio: {exc}", param=f"{where}.data", code="audio_too_long") from None
    except BadMediaError as exc:
        raise RequestError(400, f"input_audio: {exc}", param=f"{where}.data", code="invalid_value") from None


AUDIO_CHECKS = {"wav": check_wav, "mp3": check_mp3}


def check_video_url(value: Any, where: str, limits: RequestLimits) -> None:
    """A ``data:video/mp4`` base64 URL whose bytes are an MP4 that decodes in full (every frame,
    PyAV) within ``max_video_seconds``, ``max_video_frames`` and ``max_video_pixels`` as its
    header declares them. vLLM's server would take more (remote URLs, ``video/jpeg`` frame lists,
    whatever OpenCV opens) and answers a file it cannot read with a 500 or a cut-short video."""
    url = value.get("url") if isinstance(value, dict) else None
    if not isinstance(url, str):
        raise RequestError(400, "video_url needs a url (a data: URL of an MP4 video)", param=f"{where}.url",
                           code="invalid_video_url")
    media_type, data = decode_data_url(url, f"{where}.url", "video")
    if media_type not in VIDEO_TYPES:
        raise RequestError(400, f"video_url is {media_type}; send video/mp4", param=f"{where}.url",
                           code="invalid_video_format")
    try:
        check_video(data, limits.max_video_seconds, limits.max_video_frames, limits.max_video_pixels)
    except TooLargeMedia as exc:
        raise RequestError(400, f"video_url: {exc}", param=f"{where}.url", code="video_too_large") from None
    except BadMediaError as exc:
        code = "invalid_video_format" if exc.unsupported else "invalid_video"
        raise RequestError(400, f"video_url: {exc}", param=f"{where}.url", code=code) from None


DATA_URL_EXAMPLES = {"image": "data:image/png;base64,... or data:image/jpeg;base64,...",
                     "video": "data:video/mp4;base64,..."}


def decode_data_url(url: str, where: str, kind: str = "image") -> tuple[str, bytes]:
    """``(media type, bytes)`` of a base64 ``data:`` URL of a ``kind`` item (image or video)."""
    if not url.startswith("data:"):
        raise RequestError(400, "only data: URLs are accepted (the server fetches no remote media); "
                                f"send the {kind} as {DATA_URL_EXAMPLES[kind]}",
                           param=where, code=f"invalid_{kind}_url")
    m = DATA_URL.fullmatch(url)
    if m is None or ";base64" not in m["params"].lower():
        raise RequestError(400, "a malformed data: URL (want data:<type>;base64,<data>)", param=where,
                           code=f"invalid_{kind}_url")
    return m["type"].lower(), b64decode(m["data"], where)


def b64decode(text: str, where: str) -> bytes:
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise RequestError(400, f"the data is not valid base64 ({exc})", param=where, code="invalid_base64") from None
    if not data:
        raise RequestError(400, "the data is empty", param=where, code="invalid_value")
    return data


def validation_error(exc: Any) -> RequestError:
    """A pydantic ``ValidationError`` of the request model as a 400 naming the first field."""
    errors = exc.errors()
    first = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": "value_error"}
    loc = [str(p) for p in first.get("loc", ()) if not str(p).startswith("function-")]
    param = ".".join(loc) or None
    missing = first.get("type") == "missing"
    message = f"{param}: {first.get('msg')}" if param else str(first.get("msg"))
    return RequestError(400, message, param=param,
                        code="missing_required_parameter" if missing else "invalid_value")
