"""One vLLM engine instance as a test process: vLLM's own factory builds its scheduler-side and
worker-side connectors over the process's embedded mmtier cache, joined to the mmtier cluster
(``mmtier_cluster``). The sharing tests run each instance as a Ray actor (its own process);
vLLM is imported in that process only, so the test driver needs none."""

from __future__ import annotations

import torch


class VllmInstance:
    def __init__(self, fields: dict, cluster: dict):
        from tests.support import vllm_harness

        self.h = vllm_harness
        self.fields, self.cluster = fields, cluster
        self.sched, self.worker = self.h.connectors(fields, mmtier_cluster=cluster)
        self.kv = self.h.paged()          # the worker's paged KV tensors, registered at its first step

    def ready(self) -> int:
        """This engine process's pid (the test kills it)."""
        import os

        return os.getpid()

    def reopen(self, disk_dir: str) -> None:
        """A fresh, empty cache in this process over an empty ``disk_dir`` (an engine restarted
        elsewhere: over the old directory it would find what the old cache persisted at close)."""
        from mmtier.engines.connector_cache import close_shared

        self.worker.shutdown()
        close_shared()
        self.fields = {**self.fields, "disk_dir": disk_dir}
        self.sched, self.worker = self.h.connectors(self.fields, mmtier_cluster=self.cluster)
        self.kv = self.h.paged()

    def split(self, disk_dir: str) -> None:
        """vLLM's Ray executor (Ray Serve LLM on GPUs): the scheduler and the worker each in a
        process of its own, each with its own cache; here two caches of this process that share
        nothing but the cluster."""
        from vllm.config import ParallelConfig
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

        from mmtier.engines.connector_cache import close_shared

        self.worker.shutdown()
        close_shared()
        roles = []
        for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
            cfg = self.h.vllm_config(self.h.cache_fields(f"{disk_dir}/{role.name.lower()}"),
                                     mmtier_cluster=self.cluster)
            cfg.parallel_config = ParallelConfig(distributed_executor_backend="ray")
            roles.append(KVConnectorFactory.create_connector(cfg, role, None))
        self.sched, self.worker = roles
        assert self.sched.cache is not self.worker.cache
        self.kv = self.h.paged()

    def save(self, rid: str, seed: int, blocks: list[int], kv_seed: int) -> torch.Tensor:
        """Prefill ``rid`` from random paged KV (nothing held anywhere yet); waits until its
        groups are stored here, in the node store and in the registry. Returns the KV of the
        prompt's full blocks as the paged tensors hold it."""
        for name, values in self.h.paged(seed=kv_seed).items():
            self.kv[name].copy_(values)
        hit = self.h.step(self.sched, self.worker, self.h.request(rid, seed=seed), blocks, self.kv)
        assert hit == 0, hit
        return self.h.tokens_kv(self.kv, blocks, self.h.PROMPT // self.h.BS * self.h.BS)

    def load(self, rid: str, seed: int, blocks: list[int]) -> dict:
        """Prefill ``rid`` into the paged tensors, NaN-poisoned first: the hit, the blocks whose load
        failed, the KV of the hit's positions, and the cluster traffic so far."""
        for t in self.kv.values():
            t.fill_(float("nan"))
        hit = self.h.step(self.sched, self.worker, self.h.request(rid, seed=seed), blocks, self.kv)
        return {"hit": hit, "failed": sorted(self.worker.get_block_ids_with_load_errors()),
                "kv": self.h.tokens_kv(self.kv, blocks, hit), "calls": dict(self.sched.link.calls),
                "counters": dict(self.sched.link.counters), "worker_counters": dict(self.worker.link.counters),
                "worker_calls": dict(self.worker.link.calls),
                "scheduler_groups": len(self.sched.cache.inventory())}

    def hit(self, rid: str, seed: int, salt: str | None = None) -> int:
        req = self.h.request(rid, seed=seed, salt=salt)
        try:
            return self.h.ask(self.sched, req)[0]
        finally:
            self.sched.request_finished(req, [])

    def encoder_cache(self, disk_dir: str, split: bool = False) -> None:
        """vLLM's encoder-cache connectors (both roles) over another cache of this process;
        ``split``: a cache per role, as with vLLM's Ray executor (see ``split``)."""
        from vllm.config import DeviceConfig, ECTransferConfig, ParallelConfig, VllmConfig
        from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
        from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory

        from tests.support.engine_shapes import with_embeddings

        roles = []
        for role in (ECConnectorRole.SCHEDULER, ECConnectorRole.WORKER):
            fields = with_embeddings(self.h.cache_fields(f"{disk_dir}/{role.name.lower()}" if split else disk_dir))
            ec = ECTransferConfig(ec_connector="MMTierECConnector", ec_role="ec_both",
                                  ec_connector_module_path="mmtier.engines.vllm.ec",
                                  ec_connector_extra_config={"mmtier_cache": fields, "mmtier_tenant": "acme",
                                                             "mmtier_cluster": self.cluster})
            cfg = VllmConfig(ec_transfer_config=ec, device_config=DeviceConfig(device="cpu"))
            # split: vLLM's Ray executor; else both roles in this process (the in-process
            # executor; vLLM's CPU platform sets "mp" while the config is built)
            cfg.parallel_config = ParallelConfig(distributed_executor_backend="ray" if split else "uni")
            roles.append(ECConnectorFactory.create_connector(cfg, role))
        self.ec_sched, self.ec_worker = roles

    def _ec_request(self, rid: str, identifier: str):
        """A request with one image item whose processed inputs are drawn from its name (the
        connector keys its encoder output by their digest)."""
        from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        mm = [MultiModalFeatureSpec(data=self.h.image_inputs(identifier), modality="image",
                                    identifier=identifier, mm_position=PlaceholderRange(offset=0, length=16))]
        return Request(rid, [1] * 20, SamplingParams(max_tokens=1), None, mm_features=mm)

    def _ec_step(self, req, encoder_cache: dict[str, torch.Tensor], computed: torch.Tensor | None = None
                 ) -> tuple[bool, int]:
        """vLLM's calls for the request's item, one step: ``ensure_cache_available`` (deferred
        while a cluster lookup runs), ``has_cache_item``, ``update_state_after_alloc``, the
        worker's load, or its save of what the encoder ``computed``. Returns (held, deferrals)."""
        identifier = req.mm_features[0].identifier
        deferred = 0
        while not self.ec_sched.ensure_cache_available(req, 0):   # vLLM defers it a step
            deferred += 1
            self.ec_sched.link.wait()
        has = self.ec_sched.has_cache_item(identifier)
        self.ec_sched.update_state_after_alloc(req, 0)
        self.ec_worker.bind_connector_metadata(self.ec_sched.build_connector_meta(None))
        self.ec_worker.start_load_caches(encoder_cache)
        if not has and computed is not None:
            encoder_cache[identifier] = computed
            self.ec_worker.save_caches(encoder_cache, identifier)
        self.ec_worker.clear_connector_metadata()
        self.ec_sched.request_finished(req)
        return has, deferred

    def ec_save(self, identifier: str, x: torch.Tensor) -> None:
        """The encoder ran for the item (nothing held): the worker saves its output."""
        has, _ = self._ec_step(self._ec_request("save-" + identifier, identifier), {}, computed=x)
        assert not has
        self.ec_worker.link.wait()

    def ec_load(self, rid: str, identifier: str) -> dict:
        """Whether the scheduler has the item, and what the worker loads into vLLM's encoder cache."""
        encoder_cache: dict[str, torch.Tensor] = {}
        has, deferred = self._ec_step(self._ec_request(rid, identifier), encoder_cache)
        return {"has": has, "deferred": deferred, "x": encoder_cache.get(identifier),
                "calls": dict(self.ec_sched.link.calls),
                "scheduler_groups": len(self.ec_sched.cache.inventory()),
                "worker_pulled": self.ec_worker.link.counters["pulled"]}

    def digests(self, rid: str, seed: int) -> list[str]:
        """The addresses of the request's groups, as the registry is asked (digest@placement)."""
        req = self.h.request(rid, seed=seed)
        try:
            return [s.key.address for s in self.sched._plan(req).plan.segments]
        finally:
            self.sched.request_finished(req, [])
