"""Conversations through real vLLM engines (vLLM's CPU build) with mmtier's decode saves: a turn
generates an answer; the next turn's prompt repeats the previous prompt and answer token ids and
adds a message (token-id prompts: no chat template re-tokenizes anything). One scenario per
process: ``python -m tests.support.vllm_decode_scenarios NAME ARGS_JSON`` prints one ``RESULT``
line (``tests/support/engine_runs.py``).

The mmtier engine runs without vLLM's own prefix cache, so every cached token is mmtier's (as
after vLLM's pool evicted the conversation); the oracle is a plain engine with vLLM's prefix
cache on, which hits the same tokens from its own blocks (vLLM caches full blocks of generated
tokens too): tokens and log-probabilities must be bit-equal."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from tests.support.engine_runs import scenario_main  # noqa: E402
from tests.support.vllm_models import BLOCK, VOCAB, cache_fields  # noqa: E402
from tests.support.vllm_scenarios import close, engine, prompt  # noqa: E402

CHUNK_BLOCKS = 4            # chunks of 128 tokens: an answer fills a whole chunk and a part
PROMPT, ANSWER, MESSAGE = 300, 150, 40
# where a re-templated history parts from the answer's generated ids (answer index, ids there
# replaced by one other id): its first token (a template's inserted token), one token inside the
# answer's second chunk, and two tokens merged into one late in it ("\n" + "\n" -> "\n\n")
PARTED = {"first": (0, 1), "replaced": (100, 1), "merged": (139, 2)}


def mm(fields: dict, **extra) -> dict:
    return {"mmtier_cache": fields, "mmtier_tenant": "acme", "mmtier_chunk_blocks": CHUNK_BLOCKS, **extra}


def turn(llm, p: list[int], max_tokens: int, **kw) -> dict:
    """One greedy turn: the answer's token ids, their log-probabilities, the cached tokens
    (``kw``: to ``generate``, e.g. a ``lora_request``)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, detokenize=False, ignore_eos=True, logprobs=0)
    out = llm.generate([TokensPrompt(prompt_token_ids=p)], sp, use_tqdm=False, **kw)[0]
    c = out.outputs[0]
    logprobs = [lp[t].logprob for lp, t in zip(c.logprobs or [], c.token_ids)]
    time.sleep(0.3)                       # the worker's writer thread stores off the step
    return {"tokens": list(c.token_ids), "logprobs": logprobs, "cached": out.num_cached_tokens or 0}


def conversation(llm, seed: int, turns: int = 2, answer: int = ANSWER, **kw) -> list[dict]:
    """``turns`` turns of one conversation; each row also says its prompt's length and the
    whole blocks the previous turn had computed (its prompt and answer but the last token)."""
    rows, history = [], prompt(seed, PROMPT)
    for i in range(turns):
        row = turn(llm, history, answer if i < turns - 1 else 12, **kw)
        row["prompt_len"] = len(history)
        rows.append(row)
        history = history + row["tokens"] + prompt(seed * 100 + i, MESSAGE)
    for prev, row in zip(rows, rows[1:]):
        row["previous"] = (prev["prompt_len"] + len(prev["tokens"]) - 1) // BLOCK * BLOCK
    return rows


def parted(answer: list[int], at: int, width: int, seed: int) -> list[int]:
    """The first conversation's second-turn prompt as a template that re-tokenized its answer
    differently would send it: ``answer[at:at + width]`` replaced by one other id."""
    other = (answer[at] + 1) % VOCAB or 3
    return prompt(1, PROMPT) + answer[:at] + [other] + answer[at + width:] + prompt(seed, MESSAGE)


def phase_metrics(llm) -> dict[str, float]:
    out: dict[str, float] = {}
    for m in llm.get_metrics():
        if m.name == "vllm:mmtier_phase_events":
            key = f"{m.labels.get('event')}|{m.labels.get('phase')}"
            out[key] = out.get(key, 0) + (getattr(m, "value", 0) or 0)
    return out


def turns(model: str, tmp: str, dtype: str = "float32", restart: bool = False) -> dict:
    """Two conversations on an mmtier engine (decode saves on), the same on a plain engine with
    vLLM's prefix cache; with ``restart``, a fresh mmtier engine over the same disk directory
    with decode saves off: the first conversation's answer with another message (its groups
    come from disk) and a new conversation (its second turn hits its first prompt only). Before
    the first engine closes, the first conversation's second turn as re-templated histories
    whose ids part from its answer's (``PARTED``). The plain engine answers every prompt of the
    scenario (three engines in all)."""
    disk = Path(tmp) / f"disk-{dtype}"
    fields = cache_fields(disk, dtype=dtype)
    out: dict = {}
    llm = engine(model, mmtier=mm(fields), dtype=dtype)
    out["mmtier"] = [conversation(llm, 1), conversation(llm, 2)]
    time.sleep(1.5)                       # a metrics report is taken at most every second
    turn(llm, prompt(9, 40), 2)
    out["phases"] = phase_metrics(llm)
    answer = out["mmtier"][0][0]["tokens"]
    variants = {name: parted(answer, at, width, 500 + i) for i, (name, (at, width)) in enumerate(PARTED.items())}
    out["parted"] = {name: turn(llm, p, 12) for name, p in variants.items()}
    close(llm)
    # the first conversation's first answer, then another message than its second turn's
    # (whose prompt the engine saved): the hit ends where the answer's groups end
    second = prompt(1, PROMPT) + out["mmtier"][0][0]["tokens"] + prompt(777, MESSAGE)
    plain = engine(model, dtype=dtype, enable_prefix_caching=True)
    out["plain"] = [conversation(plain, 1), conversation(plain, 2)]
    out["parted_plain"] = {name: turn(plain, p, 12) for name, p in variants.items()}
    if restart:
        out["restarted_plain"] = turn(plain, second, 12)
        out["off_plain"] = conversation(plain, 3)
    close(plain)
    if restart:
        again = engine(model, mmtier=mm(fields, mmtier_save_decode=False), dtype=dtype)
        out["restarted"] = turn(again, second, 12)
        out["off"] = conversation(again, 3)
        close(again)
    return out


def shares(model: str, tmp: str, turns_n: int = 4, answer: int = 96, executor: str = "uni") -> dict:
    """Measurement: per later turn, the share of the previous turn's prompt and answer (whole
    blocks) found cached, decode saves on and off; and what the saves cost (the in-process
    executor, so the worker's counters are readable here)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    out: dict = {}
    for name, save in (("on", True), ("off", False)):
        llm = engine(model, mmtier=mm(cache_fields(None), mmtier_save_decode=save), executor=executor)
        t0 = time.perf_counter()
        rows = [r for seed in (21, 22, 23) for r in conversation(llm, seed, turns_n, answer)[1:]]
        wall = time.perf_counter() - t0
        worker = get_kv_transfer_group().connector_worker
        out[name] = {"share": [min(r["cached"], r["previous"]) / r["previous"] for r in rows],
                     "decode_saves": dict(worker.decode_saves), "wall_s": wall,
                     "generated": 3 * ((turns_n - 1) * answer + 12)}
        close(llm)
    return out


def shapes(model: str, tmp: str, shape: str) -> dict:
    """One conversation (two turns) on an mmtier engine of one shape and on a plain engine of the
    same shape with vLLM's prefix cache: ``fp8`` (an fp8 KV cache, mmtier's pages fp8 too),
    ``uni`` (the in-process executor), ``tp2`` (tensor parallel 2: each worker saves its shard of
    every decode group), ``lora`` (the conversation under adapter a; then its second turn under
    adapter b, whose scope holds nothing of a's: the answer's groups are keyed by adapter)."""
    fields, kw, gen = cache_fields(None), {}, {}
    if shape == "fp8":
        fields, kw = cache_fields(None, dtype="float8_e4m3fn"), {"kv_cache_dtype": "fp8"}
    elif shape == "uni":
        kw = {"executor": "uni"}
    elif shape == "tp2":
        from tests.support.vllm_models import KV_HEADS

        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")   # a rank per core, not pinned
        fields, kw = dict(fields, num_kv_heads=KV_HEADS // 2), {"tensor_parallel_size": 2}
    elif shape == "lora":
        from vllm.lora.request import LoRARequest

        from tests.support.vllm_models import build_lora

        adapters = {n: LoRARequest(n, i + 1, str(build_lora(model, Path(tmp) / f"lora-{n}", seed=i + 1)))
                    for i, n in enumerate("ab")}
        kw, gen = {"enable_lora": True, "max_lora_rank": 8, "max_loras": 2}, {"lora_request": adapters["a"]}
    else:
        raise ValueError(f"unknown shape {shape!r}")
    out: dict = {}
    llm = engine(model, mmtier=mm(fields), **kw)
    out["mmtier"] = conversation(llm, 1, **gen)
    time.sleep(1.5)                       # a metrics report is taken at most every second
    turn(llm, prompt(9, 40), 2, **gen)
    out["phases"] = phase_metrics(llm)
    second = prompt(1, PROMPT) + out["mmtier"][0]["tokens"] + prompt(100, MESSAGE)
    if shape == "lora":
        out["other_adapter"] = turn(llm, second, 12, lora_request=adapters["b"])
    close(llm)
    plain = engine(model, enable_prefix_caching=True, **kw)
    out["plain"] = conversation(plain, 1, **gen)
    if shape == "lora":
        out["other_adapter_plain"] = turn(plain, second, 12, lora_request=adapters["b"])
    close(plain)
    return out


SCENARIOS = {f.__name__: f for f in (turns, shares, shapes)}

if __name__ == "__main__":
    sys.exit(scenario_main(SCENARIOS, sys.argv[1:]))
