"""Recompute cost per token and modality, measured with the chat model on this machine.

``python -m benchmarks.eviction.recompute`` times the dense path (``dense_turn``: no cache) of the chat
model the demo and Serve run (``ChatModel.tiny``: a random-weight Qwen2-VL and Whisper): a text
prompt, the same prompt with an image, with a video and with an audio clip (one new token each,
so the time is the prefill: encoders + decoder over every position). A media token's cost is the
extra time over the text prompt divided by the media's tokens (an image's and a video's decoder
tokens; a clip's Whisper encoder positions, the tokens of its ``audio`` group), plus a text
token's; median of ``--repeat`` runs of each (interleaved, one torch thread). The table goes to
``benchmarks/eviction/traces/recompute_costs.json``, which the eviction benchmark reads (so its policies
see one fixed, measured table, not a fresh, noisy one per run).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from .._common import machine

TABLE = Path(__file__).resolve().parent / "traces" / "recompute_costs.json"


def measure(repeat: int = 7, text_tokens: int = 256) -> dict:
    import torch

    from mmtier.chat.dense import dense_turn
    from mmtier.chat.media import ImageItem, VideoItem
    from mmtier.chat.model import ChatModel
    from mmtier.demo.chat import audio_bytes, image_bytes, video_bytes

    torch.set_num_threads(1)
    chat = ChatModel.tiny(seed=0)
    chat.warm_up()
    text = ("the quick brown fox jumps over a lazy dog " * 8)[:text_tokens]
    image, video = image_bytes("recompute:image", (336, 336), "PNG"), video_bytes("recompute:video", 4.0)
    clip = audio_bytes("recompute:audio", 4.0)
    media_tokens = {"vision": ImageItem.read(image, chat.image_processor).tokens,
                    "video": VideoItem.read(video, chat.video_processor, chat.video_segment).tokens,
                    "audio": chat.whisper.config.max_source_positions}    # Whisper's encoder positions
    prompts = {"text": [text], "vision": [image, text], "video": [video, text], "audio": [clip, text]}
    times: dict[str, list[float]] = {m: [] for m in prompts}
    for p in prompts.values():
        dense_turn(chat, [], p, 1)                        # warm
    for _ in range(repeat):
        for m, p in prompts.items():
            t0 = time.perf_counter()
            dense_turn(chat, [], p, 1)
            times[m].append(time.perf_counter() - t0)
    med = {m: statistics.median(v) for m, v in times.items()}
    per_text = med["text"] / text_tokens
    out = {"text": per_text, "runs": repeat, "machine": machine(),
           "model": "ChatModel.tiny(seed=0) (Qwen2-VL + Whisper, random weights), dense_turn, float32 CPU"}
    for m in ("vision", "video", "audio"):
        out[m] = max(per_text, (med[m] - med["text"]) / media_tokens[m] + per_text)
        out[f"{m}_tokens"] = media_tokens[m]
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
