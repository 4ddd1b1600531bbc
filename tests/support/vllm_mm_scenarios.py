"""Real vLLM engines on a tiny LLaVA with images through vLLM's multimodal inputs, with and
without mmtier's KV and encoder-cache connectors, one scenario per process:
``python -m tests.support.vllm_mm_scenarios NAME ARGS_JSON`` prints one ``RESULT {...}`` line.

The engines, the batch helpers and the runner are ``tests/support/vllm_scenarios.py``'s; this module
adds the image prompts (``{"prompt": ..., "multi_modal_data": {"image": PIL.Image}}``, a client
``multi_modal_uuids`` where a scenario says so), the encoder-cache connector and a count of
the vision encoder's real calls: a forward hook on the model's vision tower in the in-process
(``uni``) executor, where the model is this process's. The model's one shim (a transformers
module name bound to its torchvision-free twin, ``tests/support/vllm_mm_models.py``) is installed at
import, with vLLM's LLaVA class registered as imported, so vLLM's spawned processes, which
import this module, have both."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from tests.support.vllm_mm_models import (
    cache_fields,
    image,
    image_prompt,
    text,
    torchvision_free_vllm,
)
from tests.support.vllm_scenarios import close, engine, mm


def llava_registered() -> None:
    """vLLM's own LLaVA class, imported here (under the shim) and registered with vLLM's model
    registry as the class itself: vLLM then inspects it in this process instead of in a fresh
    interpreter (``registry._run_in_subprocess``), which the shim would not reach."""
    torchvision_free_vllm()
    from vllm import ModelRegistry
    from vllm.model_executor.models.llava import LlavaForConditionalGeneration

    ModelRegistry.register_model("LlavaForConditionalGeneration", LlavaForConditionalGeneration)


llava_registered()

EC_CONNECTOR = "mmtier.engines.vllm.ec"
# 128 tokens a step: vLLM's own encoder cache holds two images, so a third pushes the first out
MM_ARGS = dict(skip_tokenizer_init=False, limit_mm_per_prompt={"image": 1}, max_model_len=1024,
               max_num_batched_tokens=128, enable_chunked_prefill=True)
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")   # collective_rpc of a function


def mm_engine(model: str, *, kv: bool = False, ec: bool = False, disk: str | None = None,
              executor: str = "uni", **extra):
    """An engine over the LLaVA; ``kv``: mmtier's KV connector, ``ec``: its encoder-cache
    connector (both over one cache, ``cache_fields(disk)``)."""
    fields = cache_fields(disk)
    kw = dict(MM_ARGS, **extra)
    if ec:
        from vllm.config import ECTransferConfig

        kw["ec_transfer_config"] = ECTransferConfig(
            ec_connector="MMTierECConnector", ec_connector_module_path=EC_CONNECTOR, ec_role="ec_both",
            ec_connector_extra_config={"mmtier_cache": fields, "mmtier_tenant": "acme",
                                       "mmtier_embed_modality": "vision_embed"})
    return engine(model, mmtier=mm(fields) if kv else None, executor=executor, **kw)


def _hook_vision_tower(worker) -> None:
    """In the worker (``collective_rpc``): count the images its model's vision tower encodes."""
    w = getattr(worker, "worker", worker)
    w.mmtier_encoded = 0

    def count(module, args, output) -> None:
        w.mmtier_encoded += int(args[0].shape[0])

    w.model_runner.model.vision_tower.register_forward_hook(count)


def _take_encoded(worker) -> int:
    w = getattr(worker, "worker", worker)
    n, w.mmtier_encoded = w.mmtier_encoded, 0
    return n


class EncoderCalls:
    """Images the vision tower of an engine's model encodes: a forward hook installed in its
    worker through vLLM's ``collective_rpc`` (this process's model under the ``uni``
    executor, the worker process's under ``mp``), after the engine's start-up profiling."""

    def __init__(self, llm):
        self.llm = llm
        llm.collective_rpc(_hook_vision_tower)

    def take(self) -> int:
        return sum(self.llm.collective_rpc(_take_encoded))


def request(prompt: str, picture, uuid: str | None = None, salt: str | None = None) -> dict:
    req = {"prompt": prompt, "multi_modal_data": {"image": picture}}
    if uuid is not None:
        req["multi_modal_uuids"] = {"image": [uuid]}
    if salt is not None:
        req["cache_salt"] = salt                 # a tenant's, as the Serve ingress sets it
    return req


def run(llm, reqs: list[dict], calls: EncoderCalls | None = None, max_tokens: int = 12) -> list[dict]:
    """Each request alone, after the previous one finished (its saves are stored): greedy
    tokens, vLLM's cached-token count, the prompt's length and image offset, and (in-process)
    how many images the vision tower encoded for it."""
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    rows = []
    for req in reqs:
        out = llm.generate([req], sp, use_tqdm=False)[0]
        ids = list(out.prompt_token_ids)
        row = {"tokens": list(out.outputs[0].token_ids), "cached": out.num_cached_tokens or 0,
               "prompt_len": len(ids), "image_at": ids.index(IMAGE_ID), "image_len": ids.count(IMAGE_ID)}
        time.sleep(0.3)                 # the worker's writer thread stores off the step
        if calls is not None:
            row["encoded"] = calls.take()
        rows.append(row)
    return rows


IMAGE_ID = 4                            # "<image>" in tests/vllm_mm_models.SPECIALS
BEFORE, AFTER, OTHER_AFTER = text(1, 40), text(2, 60), text(3, 60)


def prompts() -> dict[str, str]:
    return {"same": image_prompt(BEFORE, AFTER), "tail": image_prompt(BEFORE, OTHER_AFTER)}


# ---------------------------------------------------------------------------- scenarios
def default_executor(model: str, tmp: str) -> dict:
    """vLLM's default executor (engine core and worker in processes of their own).

    - ``kv``: the KV connector: an image + prompt (A), again, A with another tail, the same
      text with image B (a plain engine's tokens for these: ``across_instances``'s ``plain``).
    - ``ec``: the encoder-cache connector: A, three other images (vLLM's own encoder cache
      lets A go), A again."""
    p = prompts()
    a, b = image(1), image(2)
    out = {}
    llm = mm_engine(model, kv=True, executor="mp")
    out["kv"] = run(llm, [request(p["same"], a), request(p["same"], a), request(p["tail"], a),
                          request(p["same"], b)])
    close(llm)
    llm = mm_engine(model, ec=True, executor="mp")
    out["ec"] = run(llm, [request(p["same"], image(i)) for i in (1, 2, 3, 4, 1)], EncoderCalls(llm))
    close(llm)
    return out


def _keep_cache(llm) -> None:
    """Shut an in-process engine down but keep this process's mmtier cache open for the next
    engine instance (``close`` would close it)."""
    import gc

    core = getattr(llm.llm_engine, "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()
    del llm
    gc.collect()


def across_instances(model: str, tmp: str) -> dict:
    """In-process engines, one after the other, over one mmtier cache (this process's): a
    second instance starts with vLLM's encoder and KV caches empty, so what it does not
    compute came from mmtier.

    - ``first``: both connectors. It encodes image A and image C (C under the client uuid
      ``"u"``) and saves their encoder outputs and KV.
    - ``ec_second``: the encoder-cache connector alone: A again (no uuid), image B under ``"u"``,
      and A under another uuid ``"v"``.
    - ``kv_second``: the KV connector alone: B under ``"u"``, then A under ``"v"``.
    - ``plain``: A, B, C, D and A again on an engine with no connector (vLLM's own encoder
      cache lets A go: the second A is encoded again), then A with another tail."""
    p = prompts()["same"]
    a, b, c = image(1), image(2), image(3)
    out: dict = {}
    first = mm_engine(model, kv=True, ec=True)
    out["first"] = run(first, [request(p, a), request(p, c, "u")], EncoderCalls(first))
    _keep_cache(first)
    second = mm_engine(model, ec=True)
    calls = EncoderCalls(second)
    out["ec_second"] = run(second, [request(p, a), request(p, b, "u"), request(p, a, "v")], calls)
    _keep_cache(second)
    second = mm_engine(model, kv=True)
    calls = EncoderCalls(second)
    out["kv_second"] = run(second, [request(p, b, "u"), request(p, a, "v")], calls)
    close(second)
    plain = mm_engine(model)
    calls = EncoderCalls(plain)
    out["plain"] = run(plain, [request(p, a), request(p, b), request(p, c), request(p, image(4)),
                               request(p, a), request(prompts()["tail"], a)], calls)
    close(plain)
    return out


def tenants(model: str, tmp: str) -> dict:
    """In-process engines with the encoder-cache connector, one after the other over one mmtier
    cache, each starting with vLLM's own encoder cache empty (which, keyed by the item's hash and
    not by the salt, would answer any request inside one engine): image A under tenant a's
    ``cache_salt`` (encoded), then in a fresh engine under a's salt (mmtier's: not encoded), in a
    fresh one under b's salt (never a's output: encoded), in a fresh one under b's again
    (b's own: not encoded), and in a fresh one with no salt (the server tenant: encoded)."""
    p = prompts()["same"]
    out: dict = {}
    for name, salt in (("a1", "salt-a"), ("a2", "salt-a"), ("b1", "salt-b"), ("b2", "salt-b"), ("none", None)):
        llm = mm_engine(model, ec=True)
        out[name] = run(llm, [request(p, image(1), salt=salt)], EncoderCalls(llm))[0]
        _keep_cache(llm)
    return out


def sizes_only(model: str, tmp: str) -> dict:
    """Both connectors given only sizes, as a vLLM user turns them on: each reads the LLaVA's
    shape from vLLM (its text and vision KV, its projector's output width) and the two share one
    cache. A; A with another tail (a KV hit through the image). Then a second engine over the
    same disk directory: A after other text (no KV hit; the encoder-cache connector skips the
    vision tower). Plain engines: the three in one, the last alone in a fresh one."""
    from vllm.config import ECTransferConfig

    from mmtier.engines import connector_cache

    p = prompts()
    a = image(1)
    reqs = [request(p["same"], a), request(p["tail"], a), request(image_prompt(text(4, 40), AFTER), a)]
    sizes = {"mmtier_host_bytes": "64MiB", "mmtier_disk_dir": str(Path(tmp) / "disk"),
             "mmtier_disk_bytes": "256MiB", "mmtier_disk_free_floor_bytes": 0}
    out: dict = {"mmtier": []}
    for part in (reqs[:2], reqs[2:]):
        ec = ECTransferConfig(ec_connector="MMTierECConnector", ec_connector_module_path=EC_CONNECTOR,
                              ec_role="ec_both", ec_connector_extra_config=dict(sizes))
        llm = engine(model, mmtier={**sizes, "mmtier_chunk_blocks": 1}, executor="uni", ec_transfer_config=ec,
                     **MM_ARGS)
        out["mmtier"] += run(llm, part, EncoderCalls(llm))
        caches = list(connector_cache._CACHES.values())
        out["caches"] = len(caches)
        out["modalities"] = {n: [s.kind, s.page_size, s.width, s.num_kv_heads, s.head_dim, s.dtype]
                             for n, s in caches[0].cfg.modalities.items()}
        close(llm)
    plain = engine(model, executor="uni", **MM_ARGS)
    out["plain"] = run(plain, reqs, EncoderCalls(plain))
    close(plain)
    fresh = engine(model, executor="uni", **MM_ARGS)
    out["plain_fresh"] = run(fresh, reqs[2:], EncoderCalls(fresh))
    close(fresh)
    return out


SCENARIOS = {f.__name__: f for f in (default_executor, across_instances, tenants, sizes_only)}


def main(argv: list[str]) -> int:
    import json

    name, args = argv[0], json.loads(argv[1]) if len(argv) > 1 else {}
    from tests.support import vllm_scenarios

    vllm_scenarios.PREFIX_CACHING = bool(args.pop("prefix_caching", False))
    tmp = Path(args.get("tmp", "."))
    tmp.mkdir(parents=True, exist_ok=True)
    result = SCENARIOS[name](**args)
    (tmp / f"{name}.json").write_text(json.dumps(result))       # what the test read, to look at
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
