"""Content keys: full-width SHA-256 over length-prefixed, domain-separated fields.

A key covers: the key-format version, the model identity, the payload layout of the modality's
pool, the modality, the media digest (SHA-256 of the bytes computed here, plus preprocessing
parameters that change the tokens), the tenant salt and, for prefix-dependent groups, the parent
key. Every field is written as ``len(name) name len(value) value`` with 8-byte big-endian
lengths, so no two distinct field lists share an encoding (``"org_1" + "2345"`` differs from
``"org_12345"``). Keys are never truncated.

Beside its identity a key carries a placement (``place``): 8 bytes naming its chain's root
(``placement`` of the root's digest, a one-way hash of a tenant-salted key), the same for
every key derived down a chain, so the cluster can keep a chain's keys together (one registry
call a request). It is not part of the key: not hashed into the digest, not covered by the tag,
not compared; a wrong one costs the cluster a miss, never a wrong hit.

A key also carries an HMAC tag under the server-side secret, so a cache accepts only keys it (or
a cache with the same secret) issued: a caller-supplied id is never trusted on its own.
No torch here: hashlib and hmac only.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal

KEY_FORMAT_VERSION = 1
_DOMAIN = b"mmtier/content-key"
_AUTHENTIC_MEMO = 1 << 16        # keys a KeyMaker remembers as checked before it starts afresh
PLACE_BYTES = 8                 # a placement's width: routing only, never identity
Sharing = Literal["content", "prefix"]


def encode_fields(domain: bytes, fields: Iterable[tuple[str, bytes | str]]) -> bytes:
    """Length-prefixed, domain-separated encoding of named fields (the hash input)."""
    out = bytearray()
    out += len(domain).to_bytes(8, "big") + domain
    for name, value in fields:
        nb = name.encode()
        vb = value.encode() if isinstance(value, str) else bytes(value)
        out += len(nb).to_bytes(8, "big") + nb + len(vb).to_bytes(8, "big") + vb
    return bytes(out)


def media_digest(data: bytes | bytearray | memoryview, params: Mapping[str, object] | None = None) -> bytes:
    """SHA-256 of the media bytes, then of that digest and the sorted preprocessing parameters."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"media must be bytes-like, got {type(data).__name__}")
    raw = hashlib.sha256(data).digest()
    items = sorted((str(k), _param_bytes(k, v)) for k, v in (params or {}).items())
    return hashlib.sha256(encode_fields(b"mmtier/media", [("bytes", raw), *items])).digest()


def _param_bytes(name: object, value: object) -> bytes:
    """A preprocessing parameter as typed bytes: scalars only (no repr of arbitrary objects,
    whose text may be abbreviated or differ between processes)."""
    if isinstance(value, bool) or value is None:
        return f"b:{value}".encode()
    if isinstance(value, int):
        return f"i:{value}".encode()
    if isinstance(value, float):
        return b"f:" + value.hex().encode()
    if isinstance(value, str):
        return b"s:" + value.encode()
    if isinstance(value, (bytes, bytearray)):
        return b"y:" + bytes(value)
    if isinstance(value, (tuple, list)):
        return (b"t:" if isinstance(value, tuple) else b"l:") + encode_fields(b"mmtier/param-seq", [(str(i), _param_bytes(name, v)) for i, v in enumerate(value)])
    raise TypeError(f"preprocessing parameter {name!r}: {type(value).__name__} is not a str, number, "
                    "bytes or a sequence of them")


def tenant_salt(secret: str, tenant: str) -> bytes:
    """The salt of a tenant: HMAC-SHA256 under the server-side secret (never from a request)."""
    return hmac.new(secret.encode(), encode_fields(b"mmtier/tenant", [("tenant", tenant)]), hashlib.sha256).digest()


def tenant_scope(salt: bytes) -> bytes:
    """A 16-byte tenant id carried in keys, so a key of tenant A is refused for tenant B."""
    return hashlib.sha256(b"mmtier/scope" + salt).digest()[:16]


def placement(root_digest: bytes) -> bytes:
    """The placement of a chain whose root has this digest: a one-way hash of it (the root key
    is tenant-salted, so another tenant can neither guess it nor learn the key from it)."""
    return hashlib.sha256(b"mmtier/placement" + root_digest).digest()[:PLACE_BYTES]


@dataclass(frozen=True)
class ContentKey:
    """A modality group's identity. ``digest`` is the full 32-byte SHA-256. A prefix-dependent
    key derived from a parent carries the parent's digest (``parent``, covered by the tag), so a
    cache can tell whether a sequence holds the prefix the group's K/V was computed after; a
    sequence's ``prefix_key`` (a chain key) has none. ``place``: its chain root's placement
    (``None``: unknown, read as a root of its own), beside the identity, never compared."""

    digest: bytes
    modality: str
    sharing: Sharing
    scope: bytes        # 16 bytes naming the tenant (derived from its salt; not the salt)
    tag: bytes
    parent: bytes | None = None
    place: bytes | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if len(self.digest) != 32 or len(self.tag) != 32 or len(self.scope) != 16:
            raise ValueError("ContentKey digest and tag are 32 bytes, scope 16")
        if self.sharing not in ("content", "prefix"):
            raise ValueError(f"sharing must be 'content' or 'prefix', got {self.sharing!r}")
        if self.parent is not None and (self.sharing != "prefix" or len(self.parent) != 32):
            raise ValueError("only a prefix-dependent key has a parent, a 32-byte digest")
        if self.place is not None and len(self.place) != PLACE_BYTES:
            raise ValueError(f"a placement is {PLACE_BYTES} bytes")

    @property
    def hex(self) -> str:
        return self.digest.hex()

    @property
    def placement(self) -> bytes:
        """Its chain root's placement; a key with none is a root of its own."""
        return self.place if self.place is not None else placement(self.digest)

    @property
    def address(self) -> str:
        """``digest@placement`` in hex: what the cluster's registry is asked with (``split_address``)."""
        return f"{self.digest.hex()}@{self.placement.hex()}"

    def __str__(self) -> str:
        return f"{self.modality}:{self.digest.hex()}"

    def __repr__(self) -> str:
        return f"ContentKey({self.modality}:{self.digest.hex()[:16]}…, {self.sharing})"

    def to_wire(self) -> dict[str, str]:
        """Plain strings for JSON / Arrow metadata (no pickle)."""
        wire = {"digest": self.digest.hex(), "modality": self.modality, "sharing": self.sharing,
                "scope": self.scope.hex(), "tag": self.tag.hex()}
        if self.parent is not None:
            wire["parent"] = self.parent.hex()
        if self.place is not None:
            wire["place"] = self.place.hex()
        return wire

    @classmethod
    def from_wire(cls, d: Mapping[str, str]) -> ContentKey:
        parent, place = d.get("parent"), d.get("place")
        return cls(bytes.fromhex(d["digest"]), d["modality"], d["sharing"],  # type: ignore[arg-type]
                   bytes.fromhex(d["scope"]), bytes.fromhex(d["tag"]),
                   None if parent is None else bytes.fromhex(parent),
                   None if place is None else bytes.fromhex(place))


def split_address(address: str) -> tuple[str, str | None]:
    """``(digest hex, placement hex or None)`` of a ``ContentKey.address`` (or a bare digest)."""
    digest, _, place = address.partition("@")
    return digest, place or None


class KeyMaker:
    """Derives and authenticates keys for one model under one server-side secret."""

    def __init__(self, model: str, secret: str):
        self.model = model
        self._secret = secret.encode()
        self._authentic: dict[ContentKey, None] = {}   # keys issued or checked here (bounded)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_authentic": {}}       # a memo, not state: never shipped

    def derive(
        self,
        *,
        modality: str,
        layout: Iterable[tuple[str, str]],
        media: bytes,
        tenant_salt: bytes,
        parent: ContentKey | None = None,
    ) -> ContentKey:
        fields: list[tuple[str, bytes | str]] = [
            ("version", str(KEY_FORMAT_VERSION)),
            ("model", self.model),
            *((f"layout.{k}", v) for k, v in layout),
            ("modality", modality),
            ("media", media),
            ("tenant", tenant_salt),
            ("sharing", "prefix" if parent is not None else "content"),
        ]
        if parent is not None:
            self.verify(parent)
            fields.append(("parent", parent.digest))
        if parent is not None and parent.scope != tenant_scope(tenant_salt):
            from .errors import ForeignKeyError

            raise ForeignKeyError("parent key belongs to another tenant")
        digest = hashlib.sha256(encode_fields(_DOMAIN, fields)).digest()
        sharing: Sharing = "prefix" if parent is not None else "content"
        return self._make(digest, modality, sharing, tenant_scope(tenant_salt),
                          None if parent is None else parent.digest,
                          placement(digest) if parent is None else parent.placement)

    def chain(self, *, modality: str, chain_digest: bytes, tenant_salt: bytes) -> ContentKey:
        """The key naming a sequence's whole prefix (its running chain digest): a valid parent."""
        digest = hashlib.sha256(encode_fields(b"mmtier/prefix", [
            ("version", str(KEY_FORMAT_VERSION)), ("model", self.model), ("chain", chain_digest),
            ("tenant", tenant_salt)])).digest()
        return self._make(digest, modality, "prefix", tenant_scope(tenant_salt), place=placement(digest))

    def shard(self, key: ContentKey, shard: str) -> ContentKey:
        """The key of one shard of ``key``'s group (``"tp0/2"``: the first half of the KV heads,
        on rank 0 of a tensor-parallel engine): its own digest, so no shard is ever read as
        another and a TP=2 engine's groups never collide with a TP=1 engine's; modality,
        sharing and tenant scope as ``key``'s, the parent (if any) mapped alike."""
        self.verify(key)

        def mapped(digest: bytes) -> bytes:
            return hashlib.sha256(encode_fields(b"mmtier/shard", [
                ("version", str(KEY_FORMAT_VERSION)), ("model", self.model), ("key", digest),
                ("shard", shard)])).digest()

        return self._make(mapped(key.digest), key.modality, key.sharing, key.scope,
                          None if key.parent is None else mapped(key.parent), key.placement)

    def state(self, key: ContentKey, modality: str) -> ContentKey:
        """The key of the recurrent state a model's Mamba / linear-attention layers hold after
        ``key``'s group (its prefix included), in the pool ``modality``: its own digest, never
        read as ``key``'s KV; sharing, tenant scope and placement as ``key``'s, no parent."""
        self.verify(key)
        digest = hashlib.sha256(encode_fields(b"mmtier/state", [
            ("version", str(KEY_FORMAT_VERSION)), ("model", self.model), ("key", key.digest),
            ("modality", modality)])).digest()
        return self._make(digest, modality, key.sharing, key.scope, place=key.placement)

    def _make(self, digest: bytes, modality: str, sharing: Sharing, scope: bytes,
              parent: bytes | None = None, place: bytes | None = None) -> ContentKey:
        key = ContentKey(digest, modality, sharing, scope,
                         self._tag(digest, modality, sharing, scope, parent), parent, place)
        self._remember(key)
        return key

    def is_authentic(self, key: ContentKey) -> bool:
        # a key equal in every field (its tag included) to one issued or checked here is
        # authentic too: the HMAC is taken once per key, not at every call that names it
        try:
            if key in self._authentic:
                return True
        except TypeError:        # a field that does not hash (a bytearray): the HMAC alone
            return hmac.compare_digest(key.tag, self._tag(key.digest, key.modality, key.sharing, key.scope,
                                                          key.parent))
        ok = hmac.compare_digest(key.tag, self._tag(key.digest, key.modality, key.sharing, key.scope,
                                                    key.parent))
        if ok:
            self._remember(key)
        return ok

    def _remember(self, key: ContentKey) -> None:
        if len(self._authentic) >= _AUTHENTIC_MEMO:
            self._authentic.clear()
        try:
            self._authentic[key] = None
        except TypeError:
            pass

    def verify(self, key: ContentKey) -> None:
        from .errors import ForeignKeyError

        if not isinstance(key, ContentKey):
            raise ForeignKeyError(f"expected a ContentKey, got {type(key).__name__}")
        if not self.is_authentic(key):
            raise ForeignKeyError(f"key {key!r} was not issued by this cache (other model, secret, or forged)")

    def _tag(self, digest: bytes, modality: str, sharing: str, scope: bytes,
             parent: bytes | None = None) -> bytes:
        fields: list[tuple[str, bytes | str]] = [("model", self.model), ("digest", digest),
                                                 ("modality", modality), ("sharing", sharing),
                                                 ("scope", scope)]
        if parent is not None:
            fields.append(("parent", parent))
        msg = encode_fields(b"mmtier/key-tag", fields)
        return hmac.new(self._secret, msg, hashlib.sha256).digest()
