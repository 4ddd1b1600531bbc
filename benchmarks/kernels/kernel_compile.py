"""Every Triton kernel variant the launch code produces, compiled for real GPUs without one.

``python -m benchmarks.kernels.kernel_compile [--arch 80 90 100] [--jobs N] [--out DIR]`` (``./run
kernels-compile`` runs it in ``.venv-triton``: triton 3.6, the device machine's, beside CPU torch).

1. **Record.** The project's own launch code runs on meta tensors inside ``as_on_gpu()``
   (``mmtier/pages/kernels/launch.py``), so it makes a GPU's choices: ``paged_attention_triton`` (a
   real ``plan_paged_attention`` over host tables, ``_launch``, ``merge_partials``),
   ``merge_attention_states_triton`` and ``write_kv_triton`` over the whole space users can
   configure: every product of pool (fp16 / bf16 / fp32, a float32 query over a 16-bit pool,
   fp8 e4m3fn / e5m2 pages under a float16, bfloat16 or float32 query), head dim (64, 80, 96,
   112, 128, 160, 192, 256), query heads per KV head (1-8), page size (16-256), mode (decode /
   prefill / chunked prefill / non-causal) and one output or split partials (``--sample N``:
   every N-th, a quick look). ``JITFunction.run`` is replaced by a recorder: nothing runs, and
   each launch is keyed by what Triton compiles for it (kernel, constexprs, signature and
   specialization, options); the first launch of a key is kept, the others counted. What is
   compiled is what the launch code passed, so a new constexpr, option or kernel it launches
   is covered without editing this file; a ``@triton.jit`` function of the kernel modules that
   no recorded launch reaches (launched, or called by one) fails the check. A shape the launch
   code refuses (``UnsupportedError``) is listed in the report, not compiled.
2. **Compile.** Each distinct launch is bound the way ``JITFunction.run`` binds it
   (``create_function_from_signature`` over the target's backend, then ``_pack_args``: the
   same signature, constexprs, alignment and divisibility attributes) and compiled with
   ``triton.compile(..., target=GPUTarget("cuda", arch, 32))`` down to PTX and cubin by the
   ptxas in the triton wheel; no driver is asked anything.
3. **Measure and check.** Registers and spills come from ``ptxas -v`` (the log of Triton's own
   ptxas run, kept by the kernel's hash; a ``CompiledKernel`` fills ``n_regs`` / ``n_spills``
   only once loaded on a GPU); shared memory from the compiled metadata. The check fails (exit 1) on a compile error, on shared memory
   over the arch's per-block limit, or on any spill.

Writes ``OUT/kernel_compile.json`` (default ``benchmarks/results/``): the summary figures (launches
driven, variants compiled, refused shapes) and one row per variant, ``regs / spill bytes / shared KiB`` per arch; then regenerates that
folder's results pages (``benchmarks/RESULTS.md`` and ``benchmarks/results/pages/`` for the default).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import contextlib
import io
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
import time
import types
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ARCHS = (80, 90, 100)
# the most dynamic shared memory one block may use (cudaDevAttrMaxSharedMemoryPerBlockOptin)
SHARED_LIMIT = {80: 166912, 86: 101376, 89: 101376, 90: 232448, 100: 232448, 120: 101376}
# the space users can configure: every head dim from 64 to 256 a model has, every query heads per
# KV head from 1 to 8, page sizes 16-256; decode / prefill / chunked / cross, one output or KV
# splits; pools of fp16 / bf16 / fp32 (a float32 query over a 16-bit pool too) and fp8 pages
# (e4m3fn, e5m2) under a float16, bfloat16 or float32 query
PAGE_SIZES = (16, 32, 64, 128, 256)
GROUPS = (1, 2, 3, 4, 5, 6, 7, 8)
HEAD_DIMS = (64, 80, 96, 112, 128, 160, 192, 256)
MODES = ("decode", "prefill", "chunked", "cross")
# one output written directly, or KV splits (float32 partials, then the merge): split-KV is
# what long decodes and chunks take; prefill and cross-attention have work items enough
SPLITS = {"decode": (False, True), "chunked": (False, True), "prefill": (False,), "cross": (False,)}
POOLS = (("float16", "float16"), ("bfloat16", "bfloat16"), ("float32", "float32"),
         ("float16", "float32"), ("bfloat16", "float32"),            # pool dtype, query dtype
         *((f8, q) for f8 in ("float8_e4m3fn", "float8_e5m2") for q in ("float16", "bfloat16", "float32")))
WRITE_HEADS = (1, 2, 3, 4, 5, 6, 7, 8)     # KV heads of the written tokens


def _import_kernels():
    """The Triton kernel modules (``mmtier.attention.kernels``: attention, merge;
    ``mmtier.pages.kernels``: launch, write) without the rest of the cache: where ``import
    mmtier`` fails (this side environment has torch and triton only) a bare package whose path
    is ``mmtier/`` stands in, so that only the modules the kernels use load. Compiled kernels: this process
    must not run Triton's interpreter (``@triton.jit`` reads ``TRITON_INTERPRET`` when the
    kernel modules load)."""
    os.environ.pop("TRITON_INTERPRET", None)
    try:
        import mmtier  # noqa: F401
    except ImportError:
        for name in [m for m in sys.modules if m == "mmtier" or m.startswith("mmtier.")]:
            del sys.modules[name]
        shim = types.ModuleType("mmtier")
        shim.__path__ = [str(ROOT / "mmtier")]
        sys.modules["mmtier"] = shim
    from mmtier.attention.kernels import triton_attention, triton_merge
    from mmtier.pages.kernels import launch, triton_write
    return launch, triton_attention, triton_merge, triton_write


# ---------------------------------------------------------------------------------------------
# 1. record what the launch code launches


@dataclass
class Launch:
    fn: object            # the JITFunction
    args: tuple
    kwargs: dict
    scenario: str


@dataclass
class Recorder:
    """Replaces ``JITFunction.run``: each launch is keyed by what Triton compiles for it
    (``variant_key``); the first launch of each key is kept with every scenario that made one
    like it, the rest are only counted."""
    launches: list[Launch] = field(default_factory=list)     # one per compile variant
    scenarios: list[list[str]] = field(default_factory=list)
    driven: int = 0           # launches the launch code made
    refused: list[str] = field(default_factory=list)    # scenarios the launch code refused
    scenario: str = ""
    _index: dict = field(default_factory=dict)

    def __enter__(self):
        from triton.runtime.jit import JITFunction

        self._cls, self._run = JITFunction, JITFunction.run
        rec = self

        def run(fn, *args, grid, warmup, **kwargs):
            rec.add(Launch(fn, args, dict(kwargs), rec.scenario))

        JITFunction.run = run
        return self

    def __exit__(self, *exc):
        self._cls.run = self._run

    def add(self, launch: Launch) -> None:
        self.driven += 1
        key = variant_key(launch)
        i = self._index.setdefault(key, len(self.launches))
        if i == len(self.launches):
            self.launches.append(launch)
            self.scenarios.append([])
        self.scenarios[i].append(launch.scenario)


def _seqs(mode: str, page_size: int):
    """Per batch item ``(segments, query positions)``; segments ``(start, length)`` in one pool."""
    n = 3 * page_size + 5
    if mode == "decode":
        return [([(0, n)], [n - 1]), ([(0, 40)], [39])]
    if mode == "prefill":
        return [([(0, 100)], list(range(100))), ([(0, 30)], list(range(30)))]
    if mode == "chunked":
        return [([(0, n)], list(range(n - 3, n))), ([(0, 50)], list(range(47, 50)))]
    return [([(0, n)], [n, n + 1]), ([(0, 40)], [40])]     # cross: non-causal, any positions


def _attention(ta, dtype, q_dtype, head_dim, mode, page_size, group, split, kv_heads=2):
    import torch

    from mmtier.attention.kernels.layout import build_paged_kv
    from mmtier.pages.kernels import INDEX_DTYPE

    seqs = _seqs(mode, page_size)
    pages_needed = sum(-(-length // page_size) for segs, _ in seqs for _, length in segs)
    kv = torch.empty((pages_needed + 2, 2, 2, page_size, kv_heads, head_dim), dtype=dtype, device="meta")
    nxt, tables, q_pos, q_indptr = 0, [], [], [0]
    for segs, positions in seqs:
        item = []
        for start, length in segs:
            pages = list(range(nxt, nxt + -(-length // page_size)))
            nxt += len(pages)
            item.append((pages, start, length))
        tables.append(item)
        q_pos += positions
        q_indptr.append(len(q_pos))
    op = build_paged_kv(kv, 1, tables)
    q = torch.empty((len(q_pos), kv_heads * group, head_dim), dtype=q_dtype, device="meta")
    host_q = torch.tensor(q_indptr, dtype=INDEX_DTYPE)
    ta.paged_attention_triton(q, host_q.to("meta"), torch.tensor(q_pos, dtype=INDEX_DTYPE).to("meta"),
                              [op], causal=mode != "cross", num_splits=3 if split else 1,
                              host_q_indptr=host_q)


def _scenarios(sample: int):
    """The attention scenarios of the whole space (every ``sample``-th: a quick look)."""
    import itertools

    space = itertools.product(POOLS, HEAD_DIMS, GROUPS, PAGE_SIZES,
                              [(m, sp) for m in MODES for sp in SPLITS[m]])
    return itertools.islice(space, 0, None, sample)


def record_launches(modules, sample: int = 1) -> Recorder:
    """Drive the launch code over the whole space (``sample``: every n-th attention scenario);
    every launch it makes, recorded by compile variant. A shape the launch code refuses
    (``UnsupportedError``, before anything launches) is listed, not compiled."""
    import torch

    from mmtier.errors import UnsupportedError

    launch, ta, tm, tw = modules
    dtypes = (torch.float16, torch.bfloat16, torch.float32)
    torch.set_num_threads(1)          # the planner's small host tensors: threads only add waiting
    rec = Recorder()
    with rec, launch.as_on_gpu():
        for (pool, q_dtype), head_dim, g, ps, (mode, split) in _scenarios(sample):
            rec.scenario = (f"attention {pool} pool {q_dtype} q D{head_dim} G{g} page {ps} {mode} "
                            f"{'split' if split else 'single'}")
            try:
                _attention(ta, getattr(torch, pool), getattr(torch, q_dtype), head_dim, mode, ps, g, split)
            except UnsupportedError as e:
                rec.refused.append(f"{rec.scenario}: {e}")
        for dtype in dtypes:              # merges of 16-bit or float32 partial states
            for head_dim in HEAD_DIMS:
                for n in (2, 5, 70):
                    rec.scenario = f"merge {str(dtype)[6:]} D{head_dim} {n} states"
                    outs = [torch.empty((9, 28, head_dim), dtype=dtype, device="meta")] * n
                    lses = [torch.empty((9, 28), dtype=torch.float32, device="meta")] * n
                    tm.merge_attention_states_triton(outs, lses)
        for dtype in (*dtypes, torch.uint8):   # writes: sources of the pool's dtype, or float32; fp8 pages as bytes
            for src in {dtype, torch.float32} if dtype != torch.uint8 else {dtype}:
                for heads in WRITE_HEADS:
                    for head_dim in HEAD_DIMS:
                        rec.scenario = f"write {str(dtype)[6:]} pool from {str(src)[6:]} H{heads} D{head_dim}"
                        kv = torch.empty((4, 2, 2, 16, heads, head_dim), dtype=dtype, device="meta")
                        k = torch.empty((2, 5, heads, head_dim), dtype=src, device="meta")
                        ids = torch.tensor([0, 1, 2, 3, 3], dtype=torch.int32)
                        tw.write_kv_triton(kv, k, k, ids, torch.tensor([0, 1, 2, 3, 4], dtype=torch.int32))
    return rec


def unreached(modules, launches: list[Launch]) -> list[str]:
    """``@triton.jit`` functions of the kernel modules that no recorded launch launched or
    called (by name, in a launched kernel's source or, transitively, in a function it calls)."""
    from triton.runtime.jit import JITFunction

    launched = {id(x.fn): x.fn for x in launches}
    jitted = [(mod, name, obj) for mod in modules for name, obj in vars(mod).items()
              if isinstance(obj, JITFunction)]
    reached = set(launched)
    sources = "\n".join(fn.src for fn in launched.values())
    while True:
        new = [obj for _, name, obj in jitted
               if id(obj) not in reached and re.search(rf"\b{name}\s*\(", sources)]
        if not new:
            break
        reached.update(id(obj) for obj in new)
        sources += "\n" + "\n".join(obj.src for obj in new)
    return [f"{mod.__name__}.{name}" for mod, name, obj in jitted if id(obj) not in reached]


# ---------------------------------------------------------------------------------------------
# 2. bind and compile as JITFunction.run would, for an explicit target


def _bind(launch: Launch, arch: int):
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    fn = launch.fn
    kwargs = dict(launch.kwargs)
    kwargs["debug"] = kwargs.get("debug", fn.debug) or knobs.runtime.debug
    kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    return target, options, signature, constexprs, attrs


def variant_key(launch: Launch) -> tuple:
    _, options, signature, constexprs, attrs = _bind(launch, 90)
    return (launch.fn.fn.__module__, launch.fn.__name__, tuple(signature.items()),
            tuple(sorted((k, str(v)) for k, v in constexprs.items())),
            tuple(sorted((k, str(v)) for k, v in attrs.items())),
            tuple(sorted((k, str(v)) for k, v in options.__dict__.items())))


def variant_label(launch: Launch) -> str:
    """The kernel, its pointers' element types, its constexprs (specialized ints too), the
    ints known divisible by 16 and pointers not known 16-byte aligned, its warps / stages."""
    _, options, signature, constexprs, attrs = _bind(launch, 90)
    kind = launch.fn.fn.__module__.rsplit(".", 1)[-1].removeprefix("triton_")
    names = launch.fn.arg_names
    ptrs = " ".join(f"{n.removesuffix('_ptr')}:{t[1:]}" for n, t in signature.items()
                    if isinstance(t, str) and t.startswith("*") and not t.startswith("*i"))
    consts = " ".join(f"{names[k[0]]}={v}" for k, v in sorted(constexprs.items())
                      if signature.get(names[k[0]]) == "constexpr")
    divisible = {names[k[0]] for k, v in attrs.items() if "tt.divisibility" in str(v)}
    ints = ",".join(n for n in names if n in divisible and not signature[n].startswith("*"))
    unaligned = ",".join(n for n, t in signature.items() if isinstance(t, str) and t.startswith("*")
                         and n not in divisible)
    return (f"{kind} [{ptrs}] {consts} div16[{ints}]" + (f" unaligned[{unaligned}]" if unaligned else "")
            + f" w{options.num_warps}s{options.num_stages}")


_PTXAS = re.compile(r"Used (\d+) registers")
_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


def _ptxas_log(kernel, arch: int, printed: str) -> str:
    """``ptxas -v``'s report of the kernel (registers, spills), kept beside Triton's cache under
    the compiled kernel's hash: ``printed`` is the log Triton's own ptxas run printed while it
    built the cubin (``knobs.nvidia.dump_ptxas_log``); a kernel Triton found in its cache was
    not assembled again, and its kept log is read, else ptxas runs on its PTX here."""
    from triton import knobs
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    kept = Path(knobs.cache.dir) / "mmtier-ptxas" / f"{kernel.hash}-sm{arch}.log"
    if _PTXAS.search(printed):
        log = printed
    elif kept.exists():
        return kept.read_text()
    else:
        with tempfile.NamedTemporaryFile("w", suffix=".ptx") as ptx:
            ptx.write(kernel.asm["ptx"])
            ptx.flush()
            log = subprocess.run([get_ptxas(arch).path, "-lineinfo", "-v",
                                  f"--gpu-name={sm_arch_from_capability(arch)}", ptx.name, "-o", os.devnull],
                                 capture_output=True, text=True, check=True).stderr
    kept.parent.mkdir(parents=True, exist_ok=True)
    tmp = kept.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(log)
    tmp.replace(kept)
    return log


def compile_one(index: int, arch: int) -> dict:
    """Compile recorded launch ``index`` for ``sm_<arch>``; its resources, or its error."""
    import triton
    from triton import knobs
    from triton.compiler import ASTSource

    launch = _LAUNCHES[index]
    t0 = time.perf_counter()
    try:
        target, options, signature, constexprs, attrs = _bind(launch, arch)
        knobs.nvidia.dump_ptxas_log = True        # Triton's ptxas -v log, printed: kept
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            kernel = triton.compile(ASTSource(launch.fn, signature, constexprs, attrs), target=target,
                                    options=options.__dict__)
        log = _ptxas_log(kernel, arch, printed.getvalue())
        regs, spill = _PTXAS.search(log), _SPILL.search(log)
        return {"index": index, "arch": arch, "regs": int(regs.group(1)) if regs else None,
                "spill": int(spill.group(1)) + int(spill.group(2)) if spill else None,
                "shared": int(kernel.metadata.shared), "cubin_bytes": len(kernel.asm["cubin"]),
                "seconds": time.perf_counter() - t0, "error": None}
    except Exception as e:  # noqa: BLE001 -- every compile error is a finding, reported whole
        return {"index": index, "arch": arch, "error": f"{type(e).__name__}: {e}"[-2000:],
                "seconds": time.perf_counter() - t0}


_LAUNCHES: list[Launch] = []   # read by the forked workers


def supported_archs(wanted) -> list[int]:
    """The wanted archs this triton can target (sm_100 needs its Blackwell ptxas)."""
    from triton.backends.nvidia.compiler import get_ptxas

    out = []
    for arch in wanted:
        try:
            if Path(get_ptxas(arch).path).exists():
                out.append(arch)
        except (RuntimeError, AttributeError, TypeError):
            print(f"[kernel_compile] sm_{arch}: no ptxas for it in this triton; skipped", file=sys.stderr)
    return out


# ---------------------------------------------------------------------------------------------
# 3. the report


def summarize(labels: list[str], scenarios: list[list[str]], results: list[dict], archs: list[int]) -> tuple[dict, list[str]]:
    """The flat figures for the results page, and every failure as a line."""
    figures: dict = {"variants": len(labels), "compiles": len(results), "archs": " ".join(f"sm_{a}" for a in archs)}
    failures = []
    by = {(r["index"], r["arch"]): r for r in results}
    for arch in archs:
        mine = [by[(i, arch)] for i in range(len(labels))]
        ok = [r for r in mine if not r["error"]]
        figures[f"sm{arch}_compile_errors"] = len(mine) - len(ok)
        figures[f"sm{arch}_max_shared_kib"] = round(max((r["shared"] for r in ok), default=0) / 1024, 1)
        figures[f"sm{arch}_max_regs"] = max((r["regs"] or 0 for r in ok), default=0)
        figures[f"sm{arch}_spilling_variants"] = sum(1 for r in ok if r["spill"])
        figures[f"sm{arch}_max_spill_bytes"] = max((r["spill"] or 0 for r in ok), default=0)
        for r in mine:
            what = f"sm_{arch} {labels[r['index']]} (from: {scenarios[r['index']][0]})"
            if r["error"]:
                failures.append(f"compile error: {what}: {r['error']}")
            elif r["shared"] > SHARED_LIMIT[arch]:
                failures.append(f"shared memory {r['shared']} B over sm_{arch}'s {SHARED_LIMIT[arch]} B: {what}")
            elif r["spill"]:
                failures.append(f"spills {r['spill']} B ({r['regs']} registers): {what}")
    for i, label in enumerate(labels):
        cells = []
        for arch in archs:
            r = by[(i, arch)]
            cells.append(f"sm{arch} error" if r["error"] else
                         f"sm{arch} {r['regs']}r {r['spill']}B {r['shared'] / 1024:.1f}K")
        figures[f"v {label}"] = " | ".join(cells)
    return figures, failures


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", type=int, nargs="+", default=list(ARCHS),
                    help="compute capabilities to compile for (default 80 90 100; those this triton targets)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compiling processes")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results",
                    help="folder for kernel_compile.json (default benchmarks/results)")
    ap.add_argument("--limit", type=int, default=None, help="compile only the first N variants (a quick look)")
    ap.add_argument("--sample", type=int, default=1,
                    help="drive every N-th attention scenario only (a quick look; default 1: the whole space)")
    args = ap.parse_args(argv)

    t0 = time.perf_counter()
    modules = _import_kernels()
    import triton

    rec = record_launches(modules, args.sample)
    missing = unreached(modules, rec.launches)
    _LAUNCHES[:] = rec.launches
    scenarios = rec.scenarios
    if args.limit:
        del _LAUNCHES[args.limit:], scenarios[args.limit:]
    labels = [variant_label(x) for x in _LAUNCHES]
    if len(set(labels)) != len(labels):    # two variants the label does not tell apart
        seen: dict[str, int] = {}
        for i, label in enumerate(labels):
            seen[label] = seen.get(label, 0) + 1
            labels[i] = label if seen[label] == 1 else f"{label} #{seen[label]}"
    archs = supported_archs(args.arch)
    print(f"[kernel_compile] triton {triton.__version__}: {rec.driven} launches driven, "
          f"{len(_LAUNCHES)} distinct variants, compiling for {', '.join(f'sm_{a}' for a in archs)} "
          f"with {args.jobs} processes", flush=True)
    jobs = [(i, a) for i in range(len(_LAUNCHES)) for a in archs]
    results = []
    with cf.ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("fork")) as pool:
        for res in pool.map(compile_one, *zip(*jobs), chunksize=1):
            results.append(res)
            if res["error"] or res.get("spill"):
                print(f"  sm_{res['arch']} {labels[res['index']]}: "
                      f"{res['error'] or str(res['spill']) + ' B spilled'}", flush=True)
    figures, failures = summarize(labels, scenarios, results, archs)
    failures += [f"never launched by the recorded scenarios: {name}" for name in missing]
    figures.update({"launches_driven": rec.driven, "sampled_every": args.sample,
                    "refused_scenarios": len(rec.refused),
                    **{f"refused {i}": line for i, line in enumerate(rec.refused[:50])},
                    "triton": triton.__version__, "failures": len(failures),
                    "seconds": round(time.perf_counter() - t0, 1)})
    sys.path.insert(0, str(ROOT))
    from benchmarks._common import write_results

    path = write_results("kernel_compile", figures, args.out)
    from benchmarks import report

    report.main(["--results", str(args.out)])     # the results page of that folder
    for arch in archs:
        print(f"  sm_{arch}: errors {figures[f'sm{arch}_compile_errors']}, max shared "
              f"{figures[f'sm{arch}_max_shared_kib']} KiB, max regs {figures[f'sm{arch}_max_regs']}, "
              f"spilling variants {figures[f'sm{arch}_spilling_variants']} "
              f"(max {figures[f'sm{arch}_max_spill_bytes']} B)")
    print(f"[kernel_compile] {len(_LAUNCHES)} variants x {len(archs)} archs in {figures['seconds']} s; "
          f"wrote {path}")
    for line in failures:
        print("FAIL", line)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
