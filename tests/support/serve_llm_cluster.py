"""Two Ray Serve LLM replicas on two nodes, sharing through the mmtier cluster, for the tests and
``benchmarks/serve/serve_routing.py``.

A ``ray.cluster_utils.Cluster``: a head (the Serve controller, proxy and ingress, the mmtier
registry) and two nodes, each with one unit of ``mmtier_replica`` so that each of the two
replicas (their placement bundles ask one) lands on its own node. ``mmtier start`` runs a store
on every node; both engines carry mmtier's KV and encoder-cache connectors joined to it
(``mmtier_cluster``). The engine is vLLM's CPU build over the tiny random-weight LLaVA of
``tests/support/vllm_mm_models.py`` with a one-line chat template (images as ``<image>``), vLLM's own
prefix caching off, ``usage.prompt_tokens_details`` on. The app is Ray Serve LLM's
``build_dev_openai_app`` (``dev_app``: the OpenAI API plus ``/collective_rpc``, through which the test
extension ``tests/support/serve_worker_ext.py`` counts each replica's vision-encoder runs), on
127.0.0.1. ``router``: ``"affinity"`` (mmtier's router) or ``"default"`` (Serve's power of
two choices); ``ServeCluster.route`` redeploys it with the other.

Every process of the cluster gets ``tests/support/serve_site`` on its ``PYTHONPATH`` (the torchvision
shim the engines' spawned processes need) and ``mmtier.serve.llm_callback`` tells each engine
its node.
"""

from __future__ import annotations

import base64
import io
import os
import time
from pathlib import Path

import httpx

from tests.support.vllm_mm_models import build_llava, cache_fields, torchvision_free_vllm
from tests.support.vllm_models import BLOCK

ROOT = Path(__file__).resolve().parents[2]
SLOT = "mmtier_replica"
MODEL_ID = "tiny-llava"
NAMESPACE = "mmtier-serve-replicas"
APP = "default"
CHAT_TEMPLATE = ("{% for m in messages %}{% if m['content'] is string %}{{ m['content'] }}{% else %}"
                 "{% for c in m['content'] %}{% if c['type'] == 'text' %}{{ c['text'] }}{% else %} <image> "
                 "{% endif %}{% endfor %}{% endif %} {% endfor %}")


def model_dir(root: str | Path) -> Path:
    """The tiny LLaVA with its chat template (built once)."""
    path = build_llava(Path(root) / "llava")
    (path / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return path


def data_url(picture) -> str:
    buf = io.BytesIO()
    picture.save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def llm_config(model: Path, link: dict, *, max_ongoing: int = 1) -> dict:
    """The replicas' ``LLMConfig`` fields (the router is set beside it: ``dev_app``)."""
    extra = {"mmtier_cache": cache_fields(None), "mmtier_tenant": "acme", "mmtier_chunk_blocks": 1,
             "mmtier_embed_modality": "vision_embed", "mmtier_cluster": link}
    return {
        "model_loading_config": {"model_id": MODEL_ID, "model_source": str(model)},
        "accelerator_config": {"kind": "cpu"},
        "placement_group_config": {"bundles": [{"CPU": 1, SLOT: 1}], "strategy": "STRICT_PACK"},
        "callback_config": {"callback_class": "mmtier.serve.llm_callback:NodeCallback"},
        "deployment_config": {"num_replicas": 2, "max_ongoing_requests": max_ongoing},
        "engine_kwargs": {
            "skip_tokenizer_init": False, "limit_mm_per_prompt": {"image": 1}, "max_model_len": 1024,
            "max_num_batched_tokens": 256, "enable_chunked_prefill": True, "enforce_eager": True,
            "block_size": BLOCK, "dtype": "float32", "enable_prefix_caching": False, "seed": 0,
            "max_num_seqs": 4, "enable_prompt_tokens_details": True,
            "worker_extension_cls": "tests.support.serve_worker_ext.EncoderCounter",
            "kv_transfer_config": {"kv_connector": "MMTierConnector",
                                   "kv_connector_module_path": "mmtier.engines.vllm.connector",
                                   "kv_role": "kv_both", "kv_connector_extra_config": extra},
            "ec_transfer_config": {"ec_connector": "MMTierECConnector",
                                   "ec_connector_module_path": "mmtier.engines.vllm.ec",
                                   "ec_role": "ec_both", "ec_connector_extra_config": extra},
        },
    }


def dev_app(config: dict, router: str, router_timeout_s: float = 0.25):
    """``build_dev_openai_app`` for one model, its request router set as a Serve option beside
    the ``LLMConfig`` (the replicas' arguments are the same whichever router routes to them)."""
    from ray import serve
    from ray.llm._internal.serve.core.ingress import dev_ingress as dev
    from ray.serve.llm import LLMConfig

    from mmtier.serve.affinity_router import router_config

    if router not in ("affinity", "default"):
        raise ValueError(f"router must be 'affinity' or 'default', got {router!r}")
    cfg = LLMConfig(**config)
    routing = router_config(config, timeout_s=router_timeout_s) if router == "affinity" else {}
    llm = dev.build_llm_deployment(cfg, override_serve_options={"request_router_config": routing})
    ingress = dev.make_fastapi_ingress(dev.DevIngress, endpoint_map=dev.DEV_ENDPOINTS)
    return serve.deployment(ingress, **dev.DevIngress.get_deployment_options([cfg])).bind(
        llm_deployments={cfg.model_id: llm}, model_cards={cfg.model_id: dev.to_model_metadata(cfg.model_id, cfg)},
        lora_paths={})


class ServeCluster:
    """The cluster, the mmtier cache and the app (see the module docstring); ``close`` ends all."""

    def __init__(self, tmp: str | Path, *, router: str = "affinity", port: int = 8321,
                 max_ongoing: int = 1, start_timeout_s: float = 600.0, router_timeout_s: float = 0.25):
        os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tests" / "support" / "serve_site"), str(ROOT),
                                                    os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        torchvision_free_vllm()
        import ray
        from ray import serve
        from ray.cluster_utils import Cluster

        from mmtier import cluster as mma
        from mmtier.cluster.settings import ClusterSettings
        from mmtier.config import CacheConfig

        self.model = model_dir(tmp)
        self.router_timeout_s = router_timeout_s
        self.settings = ClusterSettings(namespace=NAMESPACE, device_resource="no_such_device", call_timeout_s=30.0)
        self.cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 4, "include_dashboard": False})
        self.nodes = [self.cluster.add_node(num_cpus=2, resources={SLOT: 1}) for _ in range(2)]
        self._up = True
        try:
            ray.init(address=self.cluster.address, namespace=NAMESPACE, log_to_driver=False)
            mma.start(CacheConfig(**cache_fields(None), key_secret=os.urandom(32).hex()), self.settings)
            self.link = {"namespace": NAMESPACE, "call_timeout_s": 30.0, "address": self.cluster.address}
            self.config = llm_config(self.model, self.link, max_ongoing=max_ongoing)
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            self.base = f"http://127.0.0.1:{port}"
            self.route(router, start_timeout_s)
        except BaseException:
            self.close()
            raise

    def route(self, router: str, timeout_s: float = 600.0) -> None:
        """(Re)deploy the app with ``router`` (``"affinity"`` or ``"default"``) and wait for it.
        A running app is deleted first: Serve 2.60 rolls a changed router out as new replicas
        (new engines) started beside the old ones, more engines than this machine holds. The
        mmtier stores keep what the old engines saved."""
        from ray import serve

        if getattr(self, "router", None) is not None:
            serve.delete(APP)
        serve.run(dev_app(self.config, router, self.router_timeout_s), name=APP, blocking=False)
        self.router = router
        self._wait_ready(timeout_s)

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                r = httpx.get(self.base + "/v1/models", timeout=5.0)
                if r.status_code == 200 and r.json().get("data"):
                    if len(self.encoded()) == 2:
                        return
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            time.sleep(3.0)
        raise TimeoutError(f"the app did not answer within {timeout_s:.0f} s")

    def encoded(self) -> dict[str, dict[str, int]]:
        """By node: the images its replica's vision tower encoded since the last call
        (``encoded``) and the groups its link pulled from the cluster so far (``pulled``)."""
        r = httpx.post(self.base + "/collective_rpc", json={"model": MODEL_ID, "method": "mmtier_encoded"},
                       timeout=60.0)
        r.raise_for_status()
        out: dict[str, dict[str, int]] = {}
        for rep in r.json()["results"]:
            for w in rep["worker_results"]:
                mine = out.setdefault(w["node"], {"encoded": 0, "pulled": 0})
                mine["encoded"] += int(w["encoded"])
                mine["pulled"] += int(w["pulled"])
        return out

    def registry(self):
        """The registry's shards as a client sees them (``RegistryShards``)."""
        from mmtier.cluster import RegistryShards

        return RegistryShards(self.settings)

    def holder_nodes(self, addresses: list[str]) -> list[set[str]]:
        """The nodes whose holders hold each address's group (digest@placement: the registry's answer)."""
        reg = self.registry()
        node_of = {h.name: h.node for h in reg.holders().get(60)}
        return [set() if loc is None else {node_of[h] for h, _ in loc.holders if h in node_of}
                for loc in reg.lookup(addresses).get(60)]

    def close(self) -> None:
        if not self._up:
            return
        self._up = False
        import ray
        from ray import serve

        from mmtier import cluster as mma

        try:
            if ray.is_initialized():
                try:
                    serve.shutdown()
                finally:
                    mma.shutdown(self.settings)
        finally:
            ray.shutdown()
            self.cluster.shutdown()
