"""Recompute cost per token and modality, measured with the reference model on this machine.

``python -m benchmarks.recompute`` times the dense path of ``mmtier.models.ReferenceModel``
(seeded random weights): a text prompt, the same prompt with an image, and with an audio clip
(one new token each, so the time is the prefill: encoder + decoder over every position). A
media token's cost is the extra time over the text prompt divided by the media's tokens; median
of ``--repeat`` runs of each (interleaved). The table goes to ``benchmarks/traces/
recompute_costs.json``, which the eviction benchmark reads (so its policies see one fixed,
measured table, not a fresh, noisy one per run).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from ._common import machine

TABLE = Path(__file__).resolve().parent / "traces" / "recompute_costs.json"


def measure(repeat: int = 7, text_tokens: int = 256) -> dict:
    from mmtier.models.reference import Audio, Image, ReferenceModel, Text

    model = ReferenceModel(seed=0)
    text = Text(bytes(range(32, 32 + 64)) * (text_tokens // 64))
    image = Image(bytes(range(256)) * 12)
    audio = Audio(bytes(range(256)) * 24)
    media_tokens = {"vision": model.encoders["vision"].tokens_for(image.data),
                    "audio": model.encoders["audio"].tokens_for(audio.data)}
    prompts = {"text": [text], "vision": [image, text], "audio": [audio, text]}
    times: dict[str, list[float]] = {m: [] for m in prompts}
    for p in prompts.values():
        model.generate_dense(p, max_new_tokens=1)          # warm
    for _ in range(repeat):
        for m, p in prompts.items():
            t0 = time.perf_counter()
            model.generate_dense(p, max_new_tokens=1)
            times[m].append(time.perf_counter() - t0)
    med = {m: statistics.median(v) for m, v in times.items()}
    per_text = med["text"] / text_tokens
    out = {"text": per_text, "runs": repeat, "machine": machine(),
           "model": "mmtier ReferenceModel(seed=0), dense path, float32 CPU"}
    for m in ("vision", "audio"):
        out[m] = max(per_text, (med[m] - med["text"]) / media_tokens[m] + per_text)
        out[f"{m}_tokens"] = media_tokens[m]
    out["video"] = out["vision"]                          # frames go through the vision encoder
    return out


def load_costs() -> dict[str, float]:
    """Seconds per token by modality, from the measured table."""
    data = json.loads(TABLE.read_text())
    return {m: float(data[m]) for m in ("text", "vision", "audio", "video")}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=7)
    a = ap.parse_args(argv)
    out = measure(a.repeat)
    TABLE.parent.mkdir(parents=True, exist_ok=True)
    TABLE.write_text(json.dumps(out, indent=2, sort_keys=True) + "\n")
    print(json.dumps({m: out[m] for m in ("text", "vision", "audio")}, indent=2))


if __name__ == "__main__":
    main()
