"""Real vLLM engines on tiny audio and video models (``mmtier.serve.tiny_audio``'s Qwen2-Audio,
``mmtier.serve.tiny_video``'s Qwen2-VL, the latter through mmtier's vLLM plugin), with and
without mmtier's KV and encoder-cache connectors, one scenario per process:
``python -m tests.support.vllm_av_scenarios NAME ARGS_JSON`` prints one ``RESULT {...}`` line.

The connectors are turned on as a vLLM user turns them on, with sizes only: each reads the
model's shape from vLLM (its text KV, a KV pool and an encoder-output pool per medium it takes)
and the two share one cache. Engines run in this process (vLLM's ``uni`` executor) so that a
forward hook on the model's own encoder tower counts the items it encodes; one engine after the
other over one disk directory (``close`` persists the cache there), so a later engine starts
with vLLM's caches and mmtier's memory tiers empty and what it does not compute came from
mmtier's disk tier. The engines, ``close`` and the runner are ``tests/support/vllm_scenarios.py``'s."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from mmtier.serve.tiny_audio import AUDIO_ID, SAMPLE_RATE, audio_prompt, clip
from mmtier.serve.tiny_models import text
from tests.support.vllm_scenarios import close, engine

EC_CONNECTOR = "mmtier.engines.vllm.ec"
ARGS = dict(skip_tokenizer_init=False, max_model_len=1024, max_num_batched_tokens=128, enable_chunked_prefill=True)
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")   # collective_rpc of a function


def sizes(tmp: str) -> dict:
    return {"mmtier_host_bytes": "64MiB", "mmtier_disk_dir": str(Path(tmp) / "disk"),
            "mmtier_disk_bytes": "256MiB", "mmtier_disk_free_floor_bytes": 0, "mmtier_tenant": "acme"}


def av_engine(model: str, tmp: str | None, medium: str):
    """An in-process engine; ``tmp``: both connectors over ``tmp``'s disk directory, ``None``:
    plain vLLM."""
    from vllm.config import ECTransferConfig

    kw = dict(ARGS, limit_mm_per_prompt={medium: 1})
    if tmp is None:
        return engine(model, executor="uni", **kw)
    kw["ec_transfer_config"] = ECTransferConfig(ec_connector="MMTierECConnector", ec_connector_module_path=EC_CONNECTOR,
                                                ec_role="ec_both", ec_connector_extra_config=sizes(tmp))
    return engine(model, mmtier={**sizes(tmp), "mmtier_chunk_blocks": 1}, executor="uni", **kw)


def _hook_tower(worker, tower: str) -> None:
    """In the worker (``collective_rpc``): count the calls of its model's ``tower`` (each
    request below carries one item, so a call is an item encoded)."""
    w = getattr(worker, "worker", worker)
    w.mmtier_encoded = 0

    def count(module, args, output) -> None:
        w.mmtier_encoded += 1

    getattr(w.model_runner.model, tower).register_forward_hook(count)


def _take_encoded(worker) -> int:
    w = getattr(worker, "worker", worker)
    n, w.mmtier_encoded = w.mmtier_encoded, 0
    return n


class TowerCalls:
    """Calls of an engine's encoder ``tower`` (a submodule of vLLM's model), through a forward
    hook installed after the engine's start-up profiling."""

    def __init__(self, llm, tower: str):
        self.llm = llm
        llm.collective_rpc(_hook_tower, args=(tower,))

    def take(self) -> int:
        return sum(self.llm.collective_rpc(_take_encoded))


def request(prompt: str, medium: str, item, uuid: str | None = None) -> dict:
    req = {"prompt": prompt, "multi_modal_data": {medium: item}}
    if uuid is not None:
        req["multi_modal_uuids"] = {medium: [uuid]}
    return req


def run(llm, reqs: list[dict], calls: TowerCalls, placeholder: int, max_tokens: int = 12) -> list[dict]:
    """Each request alone, after the previous one finished: greedy tokens, vLLM's cached-token
    count, the prompt's length, where its medium's placeholder tokens start and how many there
    are, and how many items the encoder tower encoded for it."""
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    rows = []
    for req in reqs:
        out = llm.generate([req], sp, use_tqdm=False)[0]
        ids = list(out.prompt_token_ids)
        rows.append({"tokens": list(out.outputs[0].token_ids), "cached": out.num_cached_tokens or 0,
                     "prompt_len": len(ids), "at": ids.index(placeholder), "len": ids.count(placeholder)})
        time.sleep(0.3)                 # the worker's writer thread stores off the step
        rows[-1]["encoded"] = calls.take()
    return rows


def pools() -> dict:
    """The pools of the cache this process's connectors opened: ``[kind, page, width]``."""
    from mmtier.engines import connector_cache

    caches = list(connector_cache._CACHES.values())
    return {"caches": len(caches),
            "modalities": {n: [s.kind, s.page_size, s.width] for n, s in caches[0].cfg.modalities.items()}}


def repeat_across_engines(model: str, tmp: str, medium: str, tower: str, placeholder: int, items: list,
                          wrap) -> dict:
    """Items A, B, C of one medium; prompts ``same`` (40 words, the item, 60 words), ``tail``
    (another 60 words after) and ``other`` (another 40 words before), ``wrap(before, after)``
    placing the item's placeholder between the words.

    - ``first``: both connectors: A same, A again, A tail, C same under the client uuid ``"u"``,
      C again (its prompt shares A's text up to the item, mid-block).
    - ``second``: a second engine over the same disk directory, both connectors: B same under
      ``"u"`` (C's uuid), A other under ``"v"`` (no KV hit: other text first), A same under ``"v"``.
    - ``plain``: vLLM alone: A same, A tail, C same, B same, A other, each in a fresh engine's
      order (its own encoder cache keeps what it encoded)."""
    a, b, c = items
    same, tail, other = wrap(text(1, 40), text(2, 60)), wrap(text(1, 40), text(3, 60)), wrap(text(4, 40), text(2, 60))
    out: dict = {}
    llm = av_engine(model, tmp, medium)
    out["first"] = run(llm, [request(same, medium, a), request(same, medium, a), request(tail, medium, a),
                             request(same, medium, c, "u"), request(same, medium, c, "u")], TowerCalls(llm, tower),
                       placeholder)
    out.update(pools())
    close(llm)
    llm = av_engine(model, tmp, medium)
    out["second"] = run(llm, [request(same, medium, b, "u"), request(other, medium, a, "v"),
                              request(same, medium, a, "v")], TowerCalls(llm, tower), placeholder)
    close(llm)
    llm = av_engine(model, None, medium)
    out["plain"] = run(llm, [request(same, medium, a), request(tail, medium, a), request(same, medium, c),
                             request(same, medium, b), request(other, medium, a)], TowerCalls(llm, tower),
                       placeholder)
    close(llm)
    return out


def audio_and_video(audio: str, video: str, tmp: str) -> dict:
    """``repeat_across_engines`` for audio on the Qwen2-Audio ``audio`` (clips of one second:
    25 placeholder tokens) and for video on the Qwen2-VL ``video`` (16 frames of 56 x 56: 32
    placeholder tokens), one process for both (one import of vLLM)."""
    from mmtier.serve.tiny_video import VIDEO_ID, frames, video_prompt

    clips = [(clip(seed), SAMPLE_RATE) for seed in (1, 2, 3)]
    videos = [frames(seed, 16) for seed in (1, 2, 3)]
    return {"audio": repeat_across_engines(audio, str(Path(tmp) / "audio"), "audio", "audio_tower", AUDIO_ID, clips,
                                           audio_prompt),
            "video": repeat_across_engines(video, str(Path(tmp) / "video"), "video", "visual", VIDEO_ID, videos,
                                           video_prompt)}


SCENARIOS = {f.__name__: f for f in (audio_and_video,)}


def main(argv: list[str]) -> int:
    from tests.support.engine_runs import scenario_main

    return scenario_main(SCENARIOS, argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
