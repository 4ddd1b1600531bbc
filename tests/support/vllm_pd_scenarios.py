"""Prefill and decode on different real vLLM engines (vLLM's CPU build, the tiny Llama), mmtier
carrying the KV over a disk tier they share, one scenario per process (``python -m
tests.support.vllm_pd_scenarios NAME ARGS_JSON`` prints one ``RESULT {...}`` line; see
``tests/support/vllm_scenarios.py`` for the engines)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from tests.support.engine_runs import scenario_main
from tests.support.vllm_models import cache_fields
from tests.support.vllm_scenarios import close, engine, generate, mm, prompt


def pd(model: str, tmp: str, dtype: str = "float32") -> dict:
    """vLLM's P/D flow on two engines over one disk directory: the prefill engine
    (``kv_producer``) runs each prompt with ``max_tokens=1`` and ``do_remote_decode``, all in
    one batch, and answers ``kv_transfer_params``; the decode engine (``kv_consumer``, its
    generated tokens' saves off, so that any file it wrote would be a prompt's) gets the prompts
    with those params, all in one batch; a plain engine answers the same prompts."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    disk = Path(tmp) / "spill"
    fields = cache_fields(disk, dtype=dtype, device_pages=1024)
    prompts = [prompt(70, 300), prompt(71, 2500), prompt(72, 97), prompt(73, 650)]
    long_model = {"max_model_len": 4096}
    p = engine(model, dtype=dtype, kv_role="kv_producer", mmtier=mm(fields), **long_model)
    sp = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False,
                        extra_args={"kv_transfer_params": {"do_remote_decode": True}})
    outs = p.generate([TokensPrompt(prompt_token_ids=x) for x in prompts], sp, use_tqdm=False)
    params = [o.kv_transfer_params for o in outs]
    first = [list(o.outputs[0].token_ids) for o in outs]
    time.sleep(0.5)
    close(p)                                   # the rest of its saves written to disk on close
    files = sorted(f.name for f in disk.glob("*.arrow"))
    d = engine(model, dtype=dtype, kv_role="kv_consumer", mmtier=mm(fields, mmtier_save_decode=False),
               **long_model)
    sps = [SamplingParams(max_tokens=12, temperature=0.0, detokenize=False, ignore_eos=True,
                          extra_args={"kv_transfer_params": x}) for x in params]
    outs = d.generate([TokensPrompt(prompt_token_ids=x) for x in prompts], sps, use_tqdm=False)
    got = [{"tokens": list(o.outputs[0].token_ids), "cached": o.num_cached_tokens or 0} for o in outs]
    close(d)
    after = sorted(f.name for f in disk.glob("*.arrow"))
    plain = engine(model, dtype=dtype, **long_model)
    want = generate(plain, prompts)
    close(plain)
    return {"lengths": [len(x) for x in prompts], "params": params, "first": first, "decode": got,
            "plain": want, "files_after_prefill": files, "files_after_decode": after}


SCENARIOS = {f.__name__: f for f in (pd,)}

if __name__ == "__main__":
    sys.exit(scenario_main(SCENARIOS, sys.argv[1:]))
