"""What both sides of mmtier's vLLM connector share, read from vLLM's config once per connector:
``ConnectorSetup`` holds the cache the engine process embeds and its cluster link
(``connector_cache``), the engine's shape and this rank's shard (``shape``), vLLM's hybrid
allocator's groups and the recurrent layers' state pools (``hybrid``), the key scheme
(``keys``), whether the worker runs in a process of its own (``split``) and then the lookup
channel between the two (``lookup_channel``). The scheduler side (``scheduler``) and the
worker side (``worker``) are each given it; the connector (``connector.MMTierConnector``) builds
it, then the side for its role, and releases the cache at shutdown (``release``)."""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

from ...content import ContentKey
from ...errors import ConfigError
from ..connector_cache import open_shared, release_shared, report_for
from . import hybrid as vllm_hybrid
from . import pd as vllm_pd
from .keys import KeyScheme
from .lookup_channel import LookupChannel
from .shape import engine_shape, engine_shard

log = logging.getLogger(__name__)
SPLIT_BACKENDS = ("ray", "mp")       # vLLM executors whose workers run in processes of their own
SAVE_DECODE_ENV = "MMTIER_SAVE_DECODE"


def save_decode_setting(extra: dict[str, Any], env: dict[str, str] | None = None) -> bool:
    """Whether the KV of generated tokens is saved (``mmtier_save_decode`` in the extra config,
    else ``MMTIER_SAVE_DECODE``; on by default). A value that is no boolean is a ``ConfigError``."""
    env = os.environ if env is None else env
    raw = extra.get("mmtier_save_decode", env.get(SAVE_DECODE_ENV))
    if raw is None or isinstance(raw, bool):
        return raw is not False
    text = str(raw).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"mmtier_save_decode must be a boolean (or {SAVE_DECODE_ENV} 0 / 1), got {raw!r}",
                      ("mmtier_save_decode",))


class ConnectorSetup:
    """See the module docstring. ``kv_transfer_config`` is the connector's (its load failure
    policy is set here); ``worker``: the connector's role is vLLM's worker."""

    def __init__(self, vllm_config, kv_transfer_config, kv_cache_config, *, worker: bool):
        extra = kv_transfer_config.kv_connector_extra_config or {}
        par = vllm_config.parallel_config
        self.block_size = vllm_config.cache_config.block_size
        # tensor / pipeline parallel: each worker holds its shard (heads, layers) of every group
        self.shard = engine_shard(vllm_config, worker=worker)
        self.split = par.distributed_executor_backend in SPLIT_BACKENDS or self.shard.count > 1
        # the shape is vLLM's, this rank's (any shape the extra config gives is checked against it)
        self.shape = engine_shape(vllm_config, kv_cache_config)
        # vLLM's hybrid allocator: several KV cache groups (full, sliding-window, recurrent),
        # each with its own block table; loads then run asynchronously (vllm_hybrid)
        self.hybrid = vllm_hybrid.kv_groups(kv_cache_config,
                                            getattr(vllm_config.cache_config, "enable_prefix_caching", None))
        if extra.get("mmtier_cluster") is not None and self.shard.count > 1:
            # refused before anything opens: the registry would have to be asked for every
            # worker's shard keys; not built yet
            raise ConfigError("mmtier_cluster with a tensor- or pipeline-parallel engine is not supported: each "
                              "worker's cache holds its own shard; drop mmtier_cluster (a disk_dir shared by the "
                              "engines still shares the groups) or run tensor_parallel_size 1",
                              ("mmtier_cluster", "tensor_parallel_size"))
        # split: the worker's process owns the cache; the scheduler's makes keys and asks it
        self.cache, self.link = open_shared(extra, lookup=self.split and not worker, engine=self.shape)
        self._released = False
        self.report = report_for(self.cache)
        self.channel = (LookupChannel(kv_transfer_config.engine_id or "engine", par.data_parallel_rank,
                                      worker=worker, cache=self.cache, shards=self.shard.count,
                                      shard=self.shard.index, key_of=self.key) if self.split else None)
        # A group that fails to load (corrupt, evicted since the lookup) is recomputed by vLLM:
        # vLLM 0.32 defaults to failing the request instead ("fail"), which only this connector's
        # extra config may keep. vLLM's scheduler reads the policy after it built this connector.
        policy = extra.get("mmtier_load_failure_policy", "recompute")
        if policy not in ("recompute", "fail"):
            raise ConfigError(f"mmtier_load_failure_policy must be 'recompute' or 'fail', got {policy!r}",
                              ("mmtier_load_failure_policy",))
        kv_transfer_config.kv_load_failure_policy = policy
        self.load_policy = policy
        # prefill and decode on different engines (``pd``): the role, and how long a decoder
        # waits for the groups its prefill engine named before the policy decides
        self.role = vllm_pd.role_setting(kv_transfer_config.kv_role)
        self.pd_wait_s = vllm_pd.wait_setting(extra)
        self.scheme = KeyScheme.from_extra(extra, self.block_size)
        # recurrent layers' states: one embedding pool per state tensor (vllm_shape.shape_fields)
        self.states: tuple[str, ...] = ()
        if self.hybrid is not None and self.hybrid.state_layers:
            self.states = self.shape.state_modalities
            missing = [m for m in self.states if m not in self.cache.cfg.modalities
                       or self.cache.cfg.spec(m).kind != "embedding"]
            if missing:
                raise ConfigError(f"modalities: this model's recurrent layers need the embedding pools {missing} "
                                  "(drop the shape fields to have them read from vLLM)", ("modalities",))
        if self.hybrid is not None:
            self.scheme = dataclasses.replace(self.scheme, chunk_blocks=vllm_hybrid.chunk_blocks_within(
                self.hybrid, self.block_size, self.scheme.chunk_blocks))
            log.info("mmtier: vLLM's hybrid allocator is on (%s): loads run while the request waits, "
                     "text chunks of %d blocks", self.hybrid.describe(), self.scheme.chunk_blocks)
        if self.cache.cfg.spec(self.scheme.text_modality).kind != "kv":
            raise ConfigError(f"{self.scheme.text_modality!r} must hold kv payloads", ("mmtier_text_modality",))
        # the KV of generated tokens, saved as their blocks fill (scheduler._decode_saves); with
        # the hybrid allocator each layer's through its group's table, recurrent states with them
        self.save_decode = save_decode_setting(extra)
        if self.save_decode and vllm_config.speculative_config is not None:
            self.save_decode = False
            log.info("mmtier: generated tokens' KV is not saved with speculative decoding (rejected draft "
                     "tokens' positions are rewritten after the scheduler counted them); prompts are saved")

    def key(self, key: ContentKey) -> ContentKey:
        """The key this worker's cache holds ``key``'s group under: its shard's, where the
        engine has several workers (``engine_shard``), else the group's own."""
        return key if self.shard.tag is None else self.cache.shard_key(key, self.shard.tag)

    def close_channel(self) -> None:
        if self.channel is not None:
            self.channel.close()

    def release(self) -> None:
        """This connector's hold on the shared cache (the last connector of the cache closes it)."""
        if not self._released:
            self._released = True
            release_shared(self.cache)
