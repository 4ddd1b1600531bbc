"""Two-turn chats through a hybrid model with mmtier's decode saves, vLLM's hybrid allocator on,
one engine per scenario process: ``python -m tests.support.vllm_hybrid_decode_scenarios chat
'{"family": ...}'`` prints ``RESULT {...}``.

``chat``: the tiny Gemma 3 (5 sliding-window layers of 64 tokens : 1 full) or Qwen3-Next (3 Gated
DeltaNet : 1 full attention) in bfloat16, vLLM's prefix cache on (its 'align' mode for recurrent
layers) over a small pool, the connector given only sizes, chunks of 2 blocks, the in-process
executor (the connector's counters are read here). Per conversation (answers of 150 and 190
tokens, so the answer's last part ends on a chunk, inside one, and the recurrent state at its end
is read where vLLM still holds it or from the worker's copy): turn 1, vLLM's own cache reset (it
lets go of the conversation), turn 2 = turn 1's prompt + answer + a new message (its hit is
mmtier's); the oracle is the same two turns under another ``cache_salt`` first (mmtier's keys
differ, vLLM's own prefix cache hits turn 1's prompt and answer from its blocks)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from tests.support.engine_runs import scenario_main
from tests.support.vllm_models import build_gemma3_family, build_qwen3_next
from tests.support.vllm_scenarios import close, engine, prompt

BUILDERS = {"gemma3": build_gemma3_family, "qwen3_next": build_qwen3_next}
# small pools: vLLM sizes each KV cache group for one 640-token request (Gemma 3: six groups of
# 20 32-token blocks; Qwen3-Next: 64-token blocks) and reuses blocks soon after it frees them
POOLS = {"gemma3": 128, "qwen3_next": 40}
PROMPT, MESSAGE, ANSWERS = 300, 40, (150, 190)


def chat(tmp: str, family: str) -> dict:
    from vllm import SamplingParams
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from vllm.inputs import TokensPrompt

    model = str(BUILDERS[family](Path(tmp) / family))
    extra = {"mmtier_device_bytes": 64 << 20, "mmtier_tenant": "acme", "mmtier_chunk_blocks": 2}
    llm = engine(model, mmtier=extra, executor="uni", dtype="bfloat16", enable_prefix_caching=True,
                 num_gpu_blocks_override=POOLS[family], max_model_len=640,
                 # vLLM 0.32 keeps sliding-window and recurrent checkpoints at the prompt's end only
                 # (retention interval 0): dense, so its own cache finds the answer (the oracle)
                 prefix_cache_retention_interval=None)
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    connector = scheduler.connector

    def turn(p: list[int], max_tokens: int, salt: str | None = None) -> dict:
        sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, detokenize=False, ignore_eos=True, logprobs=0)
        tp = TokensPrompt(prompt_token_ids=p, cache_salt=salt) if salt else TokensPrompt(prompt_token_ids=p)
        before = connector.counts["hit_tokens"]
        r = llm.generate([tp], sp, use_tqdm=False)[0]
        time.sleep(0.3)                        # the worker's writer thread stores off the step
        o = r.outputs[0]
        return {"tokens": list(o.token_ids), "cached": r.num_cached_tokens or 0,
                "from_mmtier": connector.counts["hit_tokens"] - before, "prompt_len": len(p),
                "logprobs": [d[t].logprob for d, t in zip(o.logprobs, o.token_ids)]}

    bs = llm.llm_engine.vllm_config.cache_config.block_size
    out: dict = {"block_size": bs, "save_decode": connector.scheduler.save_decode,
                 "hybrid": connector.scheduler.hybrid.describe(), "conversations": []}
    for i, answer in enumerate(ANSWERS):
        first = prompt(200 + i, PROMPT)
        message = prompt(300 + i, MESSAGE)
        oracle = [turn(first, answer, salt="oracle")]
        oracle.append(turn(first + oracle[0]["tokens"] + message, 12, salt="oracle"))
        mine = [turn(first, answer)]
        llm.reset_prefix_cache()               # vLLM's own cache lets go of the conversation
        mine.append(turn(first + mine[0]["tokens"] + message, 12))
        previous = (PROMPT + answer - 1) // bs * bs     # the whole blocks turn 1 computed
        out["conversations"].append({"answer": answer, "previous": previous, "oracle": oracle, "mmtier": mine})
    out["decode_saves"] = dict(get_kv_transfer_group().connector_worker.decode_saves)
    close(llm)
    return out


SCENARIOS = {f.__name__: f for f in (chat,)}


if __name__ == "__main__":
    sys.exit(scenario_main(SCENARIOS, sys.argv[1:]))
