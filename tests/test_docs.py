"""The repository documents itself: its design is in ``docs/``, and nothing points to files
outside the repository (a clone has only what is committed)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from tests.support.repo_paths import missing_modules

ROOT = Path(__file__).resolve().parents[1]
OUTSIDE = re.compile(r"\.\./shared|shared/DESIGN|DESIGN\.md|(?<![\w/])seed/")


def test_design_docs_are_in_the_repository():
    design = (ROOT / "docs" / "design.md").read_text()
    assert "## Public contract" in design and "(seed.md)" in design
    assert (ROOT / "docs" / "seed.md").read_text().startswith("# The design note")
    assert "docs/design.md" in (ROOT / "README.md").read_text()


def test_no_reference_to_files_outside_the_repository():
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    hits = []
    for name in files:
        if not name.endswith((".py", ".md", ".yaml", ".toml", ".sh", ".txt")) and name != "run":
            continue
        if name == "tests/test_docs.py":
            continue
        for n, line in enumerate((ROOT / name).read_text(errors="replace").splitlines(), 1):
            if OUTSIDE.search(line):
                hits.append(f"{name}:{n}: {line.strip()}")
    assert not hits, "\n".join(hits)


REPO_PATH = re.compile(r"`((?:mmtier|tests|benchmarks|configs|docs|\.ci)/[\w./-]+)`")


def test_the_paths_and_modules_the_readme_and_design_name_exist():
    """Every repository path the README and the design doc name in backticks, and every module
    they run with ``python -m``, exists (files move: the house moved 250 of them); names with a
    placeholder in capitals (``benchmarks/results/NAME.json``) are patterns, not paths."""
    missing = []
    for doc in ("README.md", "docs/design.md"):
        text = (ROOT / doc).read_text()
        for path in REPO_PATH.findall(text):
            path = path.rstrip("/.")
            if re.search(r"[A-Z]{3,}", path) or "*" in path:
                continue
            if not (ROOT / path).exists():
                missing.append(f"{doc}: {path}")
        missing += [f"{doc}: -m {module}" for module in missing_modules(text)]
    assert not missing, "\n".join(missing)


def _json(name: str) -> dict:
    import json

    return json.loads((ROOT / "benchmarks" / "results" / f"{name}.json").read_text())


def test_the_figures_the_readme_quotes_are_the_committed_results():
    """The demo's and the load benchmark's figures in the README, each against the key of the
    committed JSON it comes from (rounded as the README prints it), with their conditions
    (answer length, pool sizes, working set) beside them."""
    readme = (ROOT / "README.md").read_text()
    demo, load = _json("demo_serving"), _json("serving_load")
    quoted = {
        f"**{demo['ttft_mmtier_over_plain__later_turns']:.2f}x** plain's time": "demo later turns",
        f"| {demo['ttft_mmtier_over_plain__later_before_restart']:.2f}x |": "demo before restart",
        f"| {demo['ttft_mmtier_over_plain__later_after_restart']:.2f}x |": "demo after restart",
        f"{demo['working_set_over_vllm_kv']:.1f}x vLLM's KV pool": "demo working set",
        f"completed {load['peak_completed_mmtier_over_plain']:.2f}x plain's": "load peak ratio",
        f"p99 bound {load['p99_bound_s']:.0f} s):": "load p99 bound",
        f"{demo['working_set_tokens']:,} tokens": "demo working set tokens",
        f"({demo['vllm_kv_tokens']:,} tokens of 16 KiB)": "demo vLLM pool",
        f"64 MiB ({load['vllm_kv_tokens']:,} tokens)": "load vLLM pool",
    }
    missing = [f"{what}: README lacks {text!r}" for text, what in quoted.items() if text not in readme]
    assert not missing, "\n".join(missing)
    # the load run's answer lengths, as its JSON records them (the 8-token form of 2026-12-04
    # recorded none: its spec's max_tokens was 8)
    if "answer_tokens_median" in load:
        said = (f"answers of {load['answer_tokens_min']}-{load['answer_tokens_max']} tokens "
                f"(median {load['answer_tokens_median']})")
    else:
        said = "answers of 8 tokens"
    assert said in " ".join(readme.split()), said
    # the demo's answer lengths and the share of the previous turn found, as the README says them
    answers = (f"answers of {demo['answer_tokens_min']}-{demo['answer_tokens_max']} tokens "
               f"(median {demo['answer_tokens_median']:.0f};")
    assert answers in " ".join(readme.split()), answers
    assert demo["previous_turn_share_mmtier__min"] == 1.0 and "share 1.00 in" in readme
    assert f"vLLM alone {demo['previous_turn_share_plain__median']:.2f}" in " ".join(readme.split())
    for data in (demo, load):
        assert data["mmtier_device_bytes"] == 512 << 20 and data["mmtier_host_bytes"] == 1 << 30
    assert readme.count("512 MiB page pool and") >= 2 and "1 GiB host tier" in readme
    assert demo["vllm_kv_tokens"] * 16 << 10 == 56 << 20 and load["vllm_kv_tokens"] * 16 << 10 == 64 << 20
    # no rate sustained by either engine: the README must say so, not quote a ratio
    if load["sustainable_rate_plain"] == 0 and load["sustainable_rate_mmtier"] == 0:
        assert "Neither engine sustains any rate tried" in readme


def test_the_registry_figures_the_readme_quotes_are_the_committed_results():
    """The registry's placement comparison and model figures in the README, against the
    committed JSON (rounded as the README prints them)."""
    readme = " ".join((ROOT / "README.md").read_text().split())
    ab, model = _json("registry_scale_ab"), _json("registry_model")
    quoted = [
        f"{ab['ab_s4_chain_calls_per_request']:.2f} calls a request on 4 shards by chain against "
        f"{ab['ab_s4_key_calls_per_request']:.2f} by key hash",
        f"{ab['ab_s4_chain_requests_per_s']:.0f} against {ab['ab_s4_key_requests_per_s']:.0f} requests/s "
        f"({ab['ab_s4_chain_over_key_requests']:.2f}x)",
        f"on 8 shards {ab['ab_s8_chain_calls_per_request']:.2f} against {ab['ab_s8_key_calls_per_request']:.2f} "
        f"calls, {ab['ab_s8_chain_over_key_requests']:.2f}x the requests/s",
        f"~{round(model['saturation_rps__e__e1024'], -2):,.0f} requests/s cluster-wide at 1,024 engines",
        f"against ~{round(model['saturation_rps__c__e1024'], -2):,.0f} by key hash",
    ]
    missing = [text for text in quoted if text not in readme]
    assert not missing, missing


def test_the_retokenization_table_is_the_committed_result():
    """The README's re-tokenization rows against ``benchmarks/results/retokenize.json``."""
    readme, r = (ROOT / "README.md").read_text(), _json("retokenize")
    for key in ("tiny_llava", "tiny_qwen2_vl", "tiny_qwen2_audio", "llama_sp_llama2"):
        row = f"| {r[key + '_answers']} | {r[key + '_median_share']:.2f} | {r[key + '_whole']} |"
        assert row in readme, (key, row)
    mistral = [r[f"mistral_{k}_{f}"] for k in ("v1", "v3", "tekken") for f in ("median_share", "whole")]
    assert mistral == [1.0, 8] * 3 and "| 8 each | 1.00 | 8 | never |" in readme


def test_the_eviction_figures_the_readme_quotes_are_the_committed_results():
    """The README's eviction claim (the default policy over LRU on both real traces, S3-FIFO and
    Belady beside it, the worst ratio anywhere) against ``benchmarks/results/eviction.json``."""
    readme, e = (ROOT / "README.md").read_text(), _json("eviction")

    def over(trace: str, cap: float, name: str) -> str:
        return f"{e[f'block_hit_over_lru__{trace}__cap{cap}__{name}']:.2f}x"

    quoted = [f"**{over('conversation_2k', 0.05, 'adaptive_slru')}** LRU's block hits at 5% and "
              f"**{over('conversation_2k', 0.1, 'adaptive_slru')}** at 10%",
              f"S3-FIFO {over('conversation_2k', 0.05, 's3fifo')} / {over('conversation_2k', 0.1, 's3fifo')}",
              f"Belady {over('conversation_2k', 0.05, 'belady')} / {over('conversation_2k', 0.1, 'belady')}",
              f"first 2,000 requests {over('mooncake_2k', 0.05, 'adaptive_slru')} / "
              f"{over('mooncake_2k', 0.1, 'adaptive_slru')}",
              f"({e['target_min_over_lru__adaptive_slru']:.3f}x worst)"]
    missing = [q for q in quoted if q not in readme]
    assert not missing, missing
    assert e["default_policy"] == e["target_policy"] == "adaptive_slru"
    assert e["independent_replay_mismatches"] == e["cache_parity_mismatches"] == 0
