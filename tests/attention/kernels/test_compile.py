"""The GPU checks that run without a GPU: the compile check's harness and gpu_check.sh's dry run.

``./run kernels-compile`` (CI runs it) compiles every variant with the device machine's triton in
``.venv-triton``; here its parts run with this environment's triton: the recorder drives the
real launch code and sees what a GPU launch passes, an unlaunched kernel is reported, one
variant compiles for sm_90 through the bundled ptxas and its resources are read back.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]

_HARNESS = r'''
import json, sys, types
import benchmarks.kernels.kernel_compile as kc
modules = kc._import_kernels()
rec = kc.record_launches(modules, sample=13)      # every 13th attention scenario of the space
launches = rec.launches
out = {"launches": rec.driven, "variants": len(launches), "refused": rec.refused,
       "unreached": kc.unreached(modules, launches)}
attn = [x for x in launches if x.fn.fn.__module__ == "mmtier.attention.kernels.triton_attention"]
fp32 = [x for x in attn if x.scenario.startswith("attention float32 pool float32 q")]
out["fp32_tiles"] = sorted({(x.kwargs["BLOCK_M"], x.kwargs["BLOCK_N"]) for x in fp32})
out["options"] = sorted({(x.kwargs.get("num_warps"), x.kwargs.get("num_stages")) for x in attn})
out["kinds"] = sorted({x.fn.fn.__module__ for x in launches})
# a jit function no launch reaches is reported
import triton, triton.language as tl
@triton.jit
def orphan(x_ptr):
    tl.store(x_ptr, 1.0)
extra = types.ModuleType("extra")
extra.orphan = orphan
out["orphan"] = kc.unreached([extra], launches)
# one variant compiled for sm_90: the decode of the first fp16 scenario
kc._LAUNCHES[:] = [next(x for x in attn if x.scenario.startswith("attention float16 pool float16 q D64")
                        and "decode" in x.scenario)]
out["compiled"] = kc.compile_one(0, 90)
out["label"] = kc.variant_label(kc._LAUNCHES[0])
# shapes that differ only in group, page size and head dim (one padded head dim): one variant
import torch
one = kc.Recorder()
with one, modules[0].as_on_gpu():
    for head_dim, group, page_size in ((80, 3, 16), (96, 5, 64), (128, 7, 256)):
        kc._attention(modules[1], torch.float32, torch.float32, head_dim, "prefill", page_size, group, False)
out["one_variant"] = [one.driven, len(one.launches), len(one.scenarios[0])]
print("RESULT" + json.dumps(out))
'''


def _env():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


@pytest.mark.slow
def test_compile_harness_records_the_gpu_launches_and_compiles_one(tmp_path):
    triton = pytest.importorskip("triton")
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists():
        pytest.skip("this triton build has no bundled ptxas")
    script = tmp_path / "harness.py"     # a file: @triton.jit reads its function's source
    script.write_text(_HARNESS)
    res = subprocess.run([sys.executable, str(script)], env=_env(), cwd=ROOT, capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    out = json.loads(res.stdout.split("RESULT", 1)[1])
    assert out["launches"] > 1000 and out["unreached"] == [] and out["refused"] == []
    assert 50 < out["variants"] < out["launches"] / 4     # deduplicated by what Triton compiles
    assert out["kinds"] == ["mmtier.attention.kernels.triton_attention", "mmtier.attention.kernels.triton_merge",
                            "mmtier.pages.kernels.triton_write"]
    assert out["fp32_tiles"] == [[16, 16]]            # float32 pools: the spill-free tiles
    assert all(w in (4, 8) and s in (2, 3) for w, s in out["options"])   # a GPU's options, recorded
    assert out["orphan"] == ["extra.orphan"]
    assert out["one_variant"] == [3, 1, 3]      # group, page size, head dim: runtime ints
    c = out["compiled"]
    assert c["error"] is None, c["error"]
    assert 0 < c["regs"] <= 255 and c["spill"] == 0 and 0 < c["shared"] <= 232448
    assert "BLOCK_N=32" in out["label"] and "[q:fp16 kv:fp16" in out["label"]


@pytest.mark.slow
def test_gpu_check_dry_run_starts_every_step(tmp_path):
    """``benchmarks/gpu_check.sh --dry-run`` on a CPU machine: the tests collect, every benchmark
    starts with the step's arguments (``--help`` after them), the summary says so."""
    env = {**_env(), "PYTHON": sys.executable, "OUT": str(tmp_path)}
    res = subprocess.run(["bash", "benchmarks/gpu_check.sh", "--dry-run"], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["dry_run"] is True
    assert summary["rc"] == {"tests": "0", "kernels": "0", "connector_copy": "0", "long_context": "0"}
    log = (tmp_path / "log.txt").read_text()
    for start in ("=== tests:", "benchmarks.kernels.kernels --device cuda", "benchmarks.engines.connector_copy --device cuda",
                  "benchmarks.kernels.long_context --device cuda"):
        assert start in log, start
    assert sorted(p.name for p in tmp_path.iterdir()) == ["log.txt", "summary.json"]


def test_check_fails_on_errors_shared_memory_over_the_limit_and_spills():
    """What fails the check: a compile error, shared memory over the arch's per-block limit,
    any spilled byte; a clean variant does not, and every variant gets its row."""
    from benchmarks.kernels.kernel_compile import SHARED_LIMIT, summarize

    labels = ["clean", "broken", "too much shared", "spills"]
    scen = [[f"scenario {i}"] for i in range(4)]
    ok = {"regs": 96, "spill": 0, "shared": 20000, "error": None}
    results = [
        {"index": 0, "arch": 90, **ok},
        {"index": 1, "arch": 90, "error": "CompilationError: boom"},
        {"index": 2, "arch": 90, **ok, "shared": SHARED_LIMIT[90] + 1},
        {"index": 3, "arch": 90, **ok, "regs": 255, "spill": 4},
    ]
    figures, failures = summarize(labels, scen, results, [90])
    assert len(failures) == 3
    assert failures[0].startswith("compile error: sm_90 broken") and "boom" in failures[0]
    assert failures[1].startswith("shared memory") and "too much shared" in failures[1]
    assert failures[2].startswith("spills 4 B (255 registers)") and "scenario 3" in failures[2]
    assert figures["sm90_compile_errors"] == 1 and figures["sm90_spilling_variants"] == 1
    assert figures["v clean"] == "sm90 96r 0B 19.5K" and figures["v broken"] == "sm90 error"
    assert summarize(labels[:1], scen[:1], results[:1], [90])[1] == []


def test_the_whole_space_is_driven():
    """The attention scenarios are the whole product of the space users configure: each head
    dim 64-256, 1-8 query heads per KV head, page sizes 16-256, every mode, split or not, and
    every pool (fp8 ones under each query dtype)."""
    import benchmarks.kernels.kernel_compile as kc

    space = list(kc._scenarios(1))
    assert len(space) == len(set(space)) == len(kc.POOLS) * len(kc.HEAD_DIMS) * 8 * len(kc.PAGE_SIZES) * 6
    assert kc.GROUPS == tuple(range(1, 9)) and kc.PAGE_SIZES == (16, 32, 64, 128, 256)
    assert kc.HEAD_DIMS == (64, 80, 96, 112, 128, 160, 192, 256)
    assert {pool for pool, *_ in space} == {
        ("float16", "float16"), ("bfloat16", "bfloat16"), ("float32", "float32"), ("float16", "float32"),
        ("bfloat16", "float32"), *((f8, q) for f8 in ("float8_e4m3fn", "float8_e5m2")
                                   for q in ("float16", "bfloat16", "float32"))}
    assert (("float32", "float32"), 64, 2, 32, ("prefill", False)) in space     # issue 51's spilling shapes
    assert (("float32", "float32"), 128, 4, 16, ("chunked", True)) in space
    assert len(list(kc._scenarios(13))) == -(-len(space) // 13)
