"""Chain traces: requests as chains of prefix-dependent groups, and the JSONL importer.

A ``ChainTrace`` is what the eviction benchmark replays through ``TieredKVCache``: distinct
groups (``Item``: modality, tokens, the group its key chains) and requests, each the ordered
chain of groups its prompt needs. A request's hit is the longest cached prefix of its chain.

``load_jsonl`` reads prefix-hash traces in the form production traces are published (one JSON
object a line): ``timestamp`` (ms), ``input_length``, ``output_length`` (tokens) and ``hash_ids``
(the prompt's blocks of ``block_tokens`` tokens; equal ids mean an equal prefix up to and
including that block), optionally ``type`` (``text`` | ``image`` | ``file``, and ``audio``),
``chat_id``, ``parent_chat_id`` (``-1`` or absent: first turn) and ``turn``. Each hash id
becomes a text group chained to the block before it. In a request of type ``image`` /
``audio`` the blocks first seen in this request that lie in the user's new message (past the
parent turn's ``input_length + output_length`` tokens, when the parent is in the trace) form
one media group of that modality (``vision`` / ``audio``), chained like the rest; ``file``
content is text. A line that breaks the format raises ``TraceFormatError`` naming the line and
the field; nothing is returned then.

``from_plan`` turns the dialogue generator's plan (``tracesim.plan``) into a chain trace: the
turn's context groups in order, content-only media without a parent, and the text the turn
sealed as an output the cache stores when the turn ends.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from mmtier.errors import MMTierError

MEDIA_TYPES = {"image": "vision", "audio": "audio"}
TYPES = ("text", "file", *MEDIA_TYPES)


class TraceFormatError(MMTierError, ValueError):
    """A trace line that is not in the published format; ``line`` is 1-based."""

    def __init__(self, line: int, field_name: str, message: str):
        super().__init__(f"trace line {line}: {field_name}: {message}")
        self.line = line
        self.field = field_name


@dataclass(frozen=True)
class Item:
    uid: int
    modality: str
    tokens: int
    parent: int | None            # the group its key chains; None: a root or content-only
    blocks: int = 1               # the trace's blocks it holds (a media group: several)


@dataclass
class Request:
    time: float
    chain: list[int]              # uids, in prompt order
    outputs: list[int] = field(default_factory=list)   # groups stored when the request ends


@dataclass
class ChainTrace:
    name: str
    items: dict[int, Item]
    requests: list[Request]

    def chain_tokens(self, r: Request) -> int:
        return sum(self.items[u].tokens for u in r.chain)

    def distinct_tokens(self, modality: str | None = None) -> int:
        return sum(i.tokens for i in self.items.values() if modality in (None, i.modality))

    def first_reference_fraction(self) -> float:
        """Fraction of group references (prompt chains) that are the group's first."""
        seen: set[int] = set()
        refs = first = 0
        for r in self.requests:
            for u in r.chain:
                refs += 1
                if u not in seen:
                    first += 1
                    seen.add(u)
            seen.update(r.outputs)
        return first / refs if refs else 0.0


# ---------------------------------------------------------------------------------- JSONL
def _int(rec: dict, name: str, line: int, *, required: bool = True, minimum: int = 0) -> int | None:
    if name not in rec:
        if required:
            raise TraceFormatError(line, name, "missing")
        return None
    v = rec[name]
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise TraceFormatError(line, name, f"must be an integer >= {minimum}, got {v!r}")
    return v


def parse_record(text: str, line: int, block_tokens: int) -> dict:
    """One line -> a checked record (``TraceFormatError`` when it breaks the format)."""
    try:
        rec = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TraceFormatError(line, "json", str(exc)) from None
    if not isinstance(rec, dict):
        raise TraceFormatError(line, "json", f"expected an object, got {type(rec).__name__}")
    ts = rec.get("timestamp")
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or ts < 0:
        raise TraceFormatError(line, "timestamp", f"must be a number >= 0, got {ts!r}")
    n_in = _int(rec, "input_length", line, minimum=1)
    _int(rec, "output_length", line)
    ids = rec.get("hash_ids")
    if not isinstance(ids, list) or not ids or not all(
            isinstance(h, int) and not isinstance(h, bool) for h in ids):
        raise TraceFormatError(line, "hash_ids", "must be a non-empty list of integers")
    want = -(-n_in // block_tokens)
    if len(ids) != want:
        raise TraceFormatError(line, "hash_ids", f"{len(ids)} blocks for input_length {n_in} "
                               f"at {block_tokens} tokens a block (expected {want})")
    kind = rec.get("type", "text")
    if kind not in TYPES:
        raise TraceFormatError(line, "type", f"must be one of {TYPES}, got {kind!r}")
    _int(rec, "chat_id", line, required=False)
    parent = rec.get("parent_chat_id")
    if parent is not None and (isinstance(parent, bool) or not isinstance(parent, int) or parent < -1):
        raise TraceFormatError(line, "parent_chat_id", f"must be an integer >= -1, got {parent!r}")
    _int(rec, "turn", line, required=False)
    return rec


def open_text(path: str | Path):
    """The file as text, gunzipped when its name ends in ``.gz`` (a committed trace)."""
    return gzip.open(path, "rt", encoding="utf-8") if str(path).endswith(".gz") else open(path, encoding="utf-8")


def read_jsonl(path: str | Path, block_tokens: int = 512) -> list[dict]:
    """Every record of the file (plain or ``.gz``), checked (blank lines skipped)."""
    out = []
    with open_text(path) as f:
        for n, text in enumerate(f, 1):
            if text.strip():
                out.append(parse_record(text, n, block_tokens))
    return out


def from_records(records: Iterable[dict], block_tokens: int = 512, name: str = "jsonl") -> ChainTrace:
    """Chain groups from checked records (see the module docstring for the rules)."""
    items: dict[int, Item] = {}
    group_of: dict[int, int] = {}          # hash id -> uid of the group that holds it
    by_chat: dict[int, dict] = {}
    requests: list[Request] = []
    next_uid = 1
    for rec in records:
        ids, n_in = rec["hash_ids"], rec["input_length"]
        parent_rec = by_chat.get(rec.get("parent_chat_id", -1))
        user_start = 0
        if parent_rec is not None:
            user_start = (parent_rec["input_length"] + parent_rec["output_length"]) // block_tokens
        media = MEDIA_TYPES.get(rec.get("type", "text"))
        chain: list[int] = []
        prev: int | None = None
        media_uid: int | None = None
        for pos, h in enumerate(ids):
            tokens = min(block_tokens, n_in - pos * block_tokens)
            uid = group_of.get(h)
            if uid is None and media is not None and pos >= user_start:
                if media_uid is None:
                    media_uid, next_uid = next_uid, next_uid + 1
                    items[media_uid] = Item(media_uid, media, 0, prev, 0)
                it = items[media_uid]
                items[media_uid] = Item(media_uid, media, it.tokens + tokens, it.parent, it.blocks + 1)
                group_of[h] = uid = media_uid
            elif uid is None:
                uid, next_uid = next_uid, next_uid + 1
                items[uid] = Item(uid, "text", tokens, prev)
                group_of[h] = uid
            if not chain or chain[-1] != uid:
                chain.append(uid)
            prev = uid
        requests.append(Request(float(rec["timestamp"]) / 1e3, chain))
        if "chat_id" in rec:
            by_chat[rec["chat_id"]] = rec
    return ChainTrace(name, items, requests)


def load_jsonl(path: str | Path, block_tokens: int = 512, name: str | None = None,
               limit: int | None = None) -> ChainTrace:
    """The file's chain trace; ``limit``: its first ``limit`` requests only (their groups)."""
    records = read_jsonl(path, block_tokens)
    return from_records(records[:limit], block_tokens, name or Path(path).name.split(".")[0])


def write_jsonl(records: Iterable[dict], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for rec in records:
            f.write(json.dumps(rec, separators=(", ", ": ")) + "\n")
    return path


# ---------------------------------------------------------------------------------- dialogue
def from_plan(p, name: str = "dialogue") -> ChainTrace:
    """The dialogue generator's plan (``tracesim.Plan``) as a chain trace."""
    items: dict[int, Item] = {}
    requests: list[Request] = []
    for turn in p.turns:
        chain: list[int] = []
        prev: int | None = None
        for key, mod, tokens in turn.lookups:
            if key not in items:
                parent = None if key in p.content else prev
                items[key] = Item(key, mod, tokens, parent)
            chain.append(key)
            prev = key
        outputs = []
        if turn.seal_key is not None and turn.seal_key not in items:
            items[turn.seal_key] = Item(turn.seal_key, "text", turn.seal_tokens, prev)
            outputs.append(turn.seal_key)
        elif turn.seal_key is not None:
            outputs.append(turn.seal_key)
        requests.append(Request(float(turn.req), chain, outputs))
    return ChainTrace(name, items, requests)
