"""``benchmarks/report.py``: ``RESULTS.md`` is one page of headline figures linking a page per
benchmark (``pages/NAME.md`` in the results folder), every link resolves, and ``--results DIR``
writes its own ``DIR/RESULTS.md`` and ``DIR/pages/``, leaving the committed pages alone."""

from __future__ import annotations

import ast
import hashlib
import json
import re
import shutil
from pathlib import Path

from benchmarks import report

ROOT = Path(__file__).resolve().parents[2]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _links(path: Path) -> list[Path]:
    """The files ``path``'s relative Markdown links point at."""
    return [(path.parent / t.split("#")[0]).resolve() for t in LINK.findall(path.read_text())
            if "://" not in t and not t.startswith("#")]


def _committed() -> str:
    h = hashlib.sha256()
    for p in sorted([ROOT / "benchmarks" / "RESULTS.md", *(ROOT / "benchmarks" / "results").rglob("*.*")]):
        h.update(str(p).encode() + p.read_bytes())
    return h.hexdigest()


def _check_site(folder: Path, results: dict[str, dict]) -> None:
    """The one page links every benchmark's page, every page exists and links back, every
    headline figure is in the one page's table, every relative link resolves."""
    index = report.index_path(folder)
    text = index.read_text()
    linked = set(_links(index))
    for name in results:
        page = report.page_path(folder, name)
        assert page.exists(), page
        assert page.resolve() in linked, name
        assert index.resolve() in _links(page), name
        for target in _links(page):
            assert target.exists(), (page, target)
    for target in linked:
        assert target.exists(), target
    rows = list(report._headlines(results))
    assert rows
    for name, fig, value, _, _ in rows:
        link = report._link(report.page_path(folder, name), index.parent)
        assert f"| [{name}]({link}) | `{fig}` | {value} |" in text, (name, fig)
        assert f"| `{fig}` | {value} |" in report.page_path(folder, name).read_text(), (name, fig)
    if report.NOTES.exists():
        assert report.page_path(folder, report.NOTES_PAGE).resolve() in linked
    assert len(text.splitlines()) < 250


def test_committed_page_links_every_committed_page():
    folder = report.RESULTS
    index = report.index_path(folder)
    pages = {p.resolve() for p in (folder / report.PAGES).rglob("*.md")}
    assert pages, "no pages under benchmarks/results/pages"
    assert pages <= set(_links(index))
    for page in [index, *pages]:
        for target in _links(page):
            assert target.exists(), (page, target)


def test_results_dir_gets_its_own_page_and_pages(tmp_path):
    before = _committed()
    for src in sorted(report.RESULTS.glob("*.json")):
        shutil.copy(src, tmp_path / src.name)
    (tmp_path / "gpu").mkdir()
    (tmp_path / "gpu" / "kernels.json").write_text(json.dumps(
        {"gpu_paged_over_contiguous": 1.05, "gpu_bandwidth_fraction": 0.9, "machine": "H200", "date": "2026-12-04"}))
    (tmp_path / "pages").mkdir()
    (tmp_path / "pages" / "gone.md").write_text("a page of a benchmark no longer here\n")
    results = report.load(tmp_path)
    written = report.write(results, tmp_path)
    assert written[0] == tmp_path / "RESULTS.md"
    assert not (tmp_path / "pages" / "gone.md").exists()
    _check_site(tmp_path, results)
    gpu = (tmp_path / "pages" / "gpu" / "kernels.md").read_text()
    assert "gpu_check.sh" in gpu and "| `gpu_bandwidth_fraction` | 0.9 | >= 0.85 | yes |" in gpu
    first = {p: p.read_bytes() for p in written}
    report.write(report.load(tmp_path), tmp_path)               # deterministic: the same bytes again
    assert {p: p.read_bytes() for p in written} == first
    assert _committed() == before


def test_main_with_results_dir(tmp_path):
    before = _committed()
    (tmp_path / "alloc.json").write_text(json.dumps(
        {"alloc_free_pages_per_s_batched": 2e6, "x_pairs": "1.0/2.0", "machine": "m", "date": "d"}))
    out = report.main(["--results", str(tmp_path)])
    assert out == tmp_path / "RESULTS.md"
    _check_site(tmp_path, report.load(tmp_path))
    page = (tmp_path / "pages" / "alloc.md").read_text()
    assert "Reproduce: `python -m benchmarks.pages.alloc`" in page and "| `x_pairs` | 1.0/2.0 |" in page
    assert "Not yet run here:" in out.read_text()
    assert _committed() == before


def test_the_report_reads_config_defaults_without_importing_mmtier():
    """kernel_compile writes its page through this module in .venv-triton, which has no yaml or
    pydantic: the report reads CacheConfig's defaults from the source, and imports no mmtier."""
    from mmtier.config import CacheConfig

    for field in ("eviction_policy", "put_placement", "durable_lag_s"):
        assert report._config_default(field) == CacheConfig.model_fields[field].default
    tree = ast.parse(Path(report.__file__).read_text())
    top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    names = [a.name for n in top if isinstance(n, ast.Import) for a in n.names]
    names += [n.module or "" for n in top if isinstance(n, ast.ImportFrom)]
    assert not [n for n in names if n.split(".")[0] == "mmtier"], names
