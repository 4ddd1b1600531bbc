"""The serving demo's PNG chart, drawn with Pillow (what the engines environment has; no
matplotlib there): per phase, the median time to first token of the plain engine and of the
engine with mmtier side by side, and the share of prompt tokens each served from cache."""

from __future__ import annotations

from pathlib import Path

from .serving import PHASE_TITLES, PHASES, ServingDemoReport

COLOURS = {"plain": (150, 150, 150), "mmtier": (31, 119, 180)}


def plot_serving(report: ServingDemoReport, path: Path) -> Path:
    from PIL import Image, ImageDraw

    f = report.figures
    w, h, left, bottom, top = 900, 480, 80, 90, 60
    im = Image.new("RGB", (w, h), "white")
    d = ImageDraw.Draw(im)
    d.text((left, 15), f"Time to first token per phase (median), {f['conversations']} conversations x "
                       f"{f['turns']} turns; vLLM prefix cache on in both", fill="black")
    d.text((left, 32), f"later turns: mmtier / plain = {f['ttft_mmtier_over_plain__later_turns']:.2f}x (paired); "
                       f"answers equal {f['check_turns'] - f['check_mismatches']}/{f['check_turns']}", fill="black")
    values = [(p, f[f"ttft_s_plain__{p}"] * 1e3, f[f"ttft_s_mmtier__{p}"] * 1e3) for p in PHASES
              if f[f"requests__{p}"]]
    top_ms = max(max(a, b) for _, a, b in values) * 1.15 or 1.0
    y0, y1 = h - bottom, top
    d.line((left, y0, w - 20, y0), fill="black")
    d.line((left, y0, left, y1), fill="black")
    for k in range(5):
        v = top_ms * k / 4
        y = y0 - (y0 - y1) * k / 4
        d.line((left - 4, y, left, y), fill="black")
        d.text((8, y - 6), f"{v:.0f} ms", fill="black")
    slot = (w - 20 - left) / len(values)
    for n, (p, plain, mm) in enumerate(values):
        x = left + n * slot + slot * 0.15
        bw = slot * 0.3
        for k, (name, v) in enumerate((("plain", plain), ("mmtier", mm))):
            bx = x + k * bw
            by = y0 - (y0 - y1) * v / top_ms
            d.rectangle((bx, by, bx + bw - 4, y0), fill=COLOURS[name])
            cached = f[f"cached_fraction_{name}__{p}"]
            d.text((bx + 2, by - 28), f"{v:.0f} ms", fill="black")
            d.text((bx + 2, by - 14), f"{100 * cached:.0f}% cached", fill="black")
        d.text((x, y0 + 8), PHASE_TITLES[p], fill="black")
    for k, name in enumerate(("plain", "mmtier")):
        lx = left + k * 200
        d.rectangle((lx, h - 40, lx + 14, h - 26), fill=COLOURS[name])
        d.text((lx + 20, h - 40), "vLLM alone" if name == "plain" else "vLLM + mmtier", fill="black")
    path.parent.mkdir(parents=True, exist_ok=True)
    im.save(path, "PNG")
    return path
