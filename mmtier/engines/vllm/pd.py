"""Prefill and decode on different vLLM engines, mmtier carrying the KV (no vLLM import).

The flow is vLLM's (as Ray Serve LLM's ``build_pd_openai_app`` drives it): the prefill request
carries ``kv_transfer_params = {"do_remote_decode": true, ...}`` and ``max_tokens=1``; its
answer's ``kv_transfer_params`` go with the decode request. With mmtier the KV goes through
the cache, under content keys: a prefill engine (``kv_role`` ``kv_producer``, or ``kv_both``)
saves the prompt's whole blocks as every engine does and answers ``handoff_params``: the
digests of the groups it saved (a leading run of the prompt's plan) and the tokens they cover.
The decode engine (``kv_consumer``) plans the same prompt into the same keys, so it could
simply look them up; the params tell it which groups the prefill engine *stored*, so that it
waits for them to be visible (the prefill's writer thread and the cluster's publish may lag its
answer) instead of missing them and recomputing (``PendingHandoff``). Past ``wait_s`` the
policy decides (``mmtier_load_failure_policy``): ``"recompute"`` takes what is held and vLLM
computes the rest; ``"fail"`` claims the named tokens, whose load then fails, and vLLM fails
the request (its own ``kv_load_failure_policy="fail"``).

What is exact: only whole blocks are saved (a prompt's last partial block is not a group), and
the decoder's hit stops below the prompt's last token (vLLM computes it itself), so the decode
engine recomputes at most a block and a token. Neither the params' names nor their count are
trusted beyond waiting: a group is loaded only under the key the decoder computed itself.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ...errors import ConfigError

GROUPS = "mmtier_groups"           # the digests (hex) of the groups the prefill engine saved, in order
TOKENS = "mmtier_tokens"           # the prompt positions they cover, [0, mmtier_tokens)
WAIT_S = 30.0                      # default: how long a decoder waits for the named groups
ROLES = ("kv_producer", "kv_consumer", "kv_both")


def wait_setting(extra: dict[str, Any]) -> float:
    """``mmtier_pd_wait_s`` of the extra config (seconds > 0; default ``WAIT_S``)."""
    raw = extra.get("mmtier_pd_wait_s", WAIT_S)
    try:
        value = float(raw)
    except (TypeError, ValueError):
        value = -1.0
    if not value > 0:
        raise ConfigError(f"mmtier_pd_wait_s must be a number of seconds > 0, got {raw!r}", ("mmtier_pd_wait_s",))
    return value


def role_setting(kv_role: str | None) -> str:
    role = kv_role or "kv_both"
    if role not in ROLES:
        raise ConfigError(f"kv_role must be one of {ROLES}, got {kv_role!r}", ("kv_role",))
    return role


def wants_handoff(params: dict[str, Any] | None) -> bool:
    """Whether a request asks its engine to prefill for another one (vLLM's ``do_remote_decode``)."""
    return isinstance(params, dict) and bool(params.get("do_remote_decode"))


def handoff_params(digests: Sequence[str], tokens: int) -> dict[str, Any]:
    """What a prefill engine answers in ``kv_transfer_params``: the saved groups, in order."""
    return {GROUPS: list(digests), TOKENS: int(tokens)}


@dataclass
class PendingHandoff:
    """A decode request's wait for the groups its prefill engine named."""

    names: frozenset[str]
    tokens: int
    deadline: float
    settled: bool = False
    timed_out: bool = False

    @classmethod
    def from_params(cls, params: dict[str, Any] | None, wait_s: float) -> PendingHandoff | None:
        """``None`` where the params name no groups (no P/D, or another connector's params);
        malformed names are ignored (the decoder's own keys decide what loads)."""
        if not isinstance(params, dict) or not isinstance(params.get(GROUPS), list):
            return None
        names = frozenset(n for n in params[GROUPS] if isinstance(n, str))
        tokens = params.get(TOKENS)
        tokens = tokens if isinstance(tokens, int) and tokens >= 0 else 0
        return cls(names, tokens, time.monotonic() + wait_s) if names else None

    def wanted(self, digests: Sequence[str]) -> int:
        """How many leading groups of the decoder's plan the prefill engine named."""
        n = 0
        while n < len(digests) and digests[n] in self.names:
            n += 1
        return n

    def expired(self) -> bool:
        return time.monotonic() >= self.deadline
