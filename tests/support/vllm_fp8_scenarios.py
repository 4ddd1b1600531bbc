"""A real vLLM engine (vLLM's CPU build) with an fp8 KV cache (``kv_cache_dtype="fp8"``: e4m3,
vLLM's default scales) and mmtier's connector, against a plain engine with the same fp8 cache:
``python -m tests.support.vllm_fp8_scenarios fp8 ARGS_JSON`` prints one ``RESULT {...}`` line (the
helpers and conventions of ``tests/support/vllm_scenarios.py``)."""

from __future__ import annotations

import json
import sys

from tests.support.vllm_models import cache_fields
from tests.support.vllm_scenarios import close, engine, mm, one_by_one, prompt


def fp8(model: str, tmp: str) -> dict:
    """A prompt twice on an engine whose KV cache is fp8, mmtier's pages fp8 too; then the same
    on a plain engine with the same fp8 cache (its prefix cache as the scenario says)."""
    p = prompt(40, 400)
    out = {}
    fields = cache_fields(None, dtype="float8_e4m3fn")
    for name, kw in (("mmtier", {"mmtier": mm(fields)}), ("plain", {})):
        llm = engine(model, kv_cache_dtype="fp8", **kw)
        out[name] = one_by_one(llm, [p, p])
        close(llm)
    return out


def main(argv: list[str]) -> int:
    import tests.support.vllm_scenarios as base

    name, args = argv[0], json.loads(argv[1]) if len(argv) > 1 else {}
    base.PREFIX_CACHING = bool(args.pop("prefix_caching", False))
    result = {"fp8": fp8}[name](**args)
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
