"""A heavy-tailed multi-turn prefix trace, written in the published JSONL form.

Production prefix traces (a one-hour conversation trace published with 512-token blocks) show:
most block references are first references (about 64%), one shared system prefix starts every
request, a conversation's chain grows to ~250 blocks, and at 5% of distinct blocks LRU's prefix
hit ratio is about a fifth of the offline optimum's. This generator reproduces those shapes:

- every request starts with the same system prefix (``system_blocks`` whole blocks);
- a chat may open on a shared document (RAG context, a file, a few-shot template) drawn from a
  Zipf catalogue, so some long prefixes are reused across chats;
- chats run a heavy-tailed number of turns (discrete Pareto); each turn's input is the chat so
  far (previous inputs and outputs) plus the new user message, so the chain grows until it
  would pass ``max_blocks`` and the chat ends;
- think times between turns are heavy-tailed (Pareto): most users answer within a minute, some
  come back much later, past what an LRU of a few percent remembers;
- follow-up turns carry an image (``type: image``, 576-1280 tokens, Qwen2-VL-like grids) or an
  audio clip (``type: audio``, 1500 tokens, a 30 s Whisper window) with ``p_image`` / ``p_audio``.

Block hashes follow prefix hashing: a block's id is shared exactly when everything up to the end
of the block is; a prompt's last, partial block is new at every turn. Records carry
``timestamp`` (ms), ``input_length``, ``output_length``, ``hash_ids``, ``type``, ``chat_id``,
``parent_chat_id`` (-1 on a first turn) and ``turn``; ``chains.load_jsonl`` reads them back.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class HeavyTailConfig:
    seed: int = 0
    requests: int = 2000
    duration_s: float = 3600.0
    block_tokens: int = 512
    system_blocks: int = 1
    max_blocks: int = 250
    docs: int = 300                      # shared-document catalogue (Zipf popularity)
    doc_zipf: float = 1.1
    p_doc: float = 0.1                   # a chat opens on a shared document
    doc_blocks_median: float = 12.0
    turns_alpha: float = 1.9             # turns per chat: 1 + discrete Pareto
    turns_max: int = 80
    think_s: float = 300.0               # Pareto scale of the gap between turns
    think_alpha: float = 1.0
    user_tokens_median: float = 6000.0   # pasted documents, code, long questions
    user_sigma: float = 0.8
    output_tokens_median: float = 300.0
    output_sigma: float = 0.7
    p_image: float = 0.25
    p_audio: float = 0.1

    def __post_init__(self) -> None:
        if self.requests <= 0 or self.block_tokens <= 0 or self.max_blocks <= self.system_blocks:
            raise ValueError("requests and block_tokens must be positive, max_blocks > system_blocks")


class _Chat:
    def __init__(self, chat_id: int, prefix: list[int], prefix_tokens: int):
        self.id = chat_id
        self.full = list(prefix)          # ids of the full blocks of the stream so far
        self.tokens = prefix_tokens       # tokens of the stream so far
        self.turn = 0
        self.parent = -1


def generate(cfg: HeavyTailConfig | None = None) -> list[dict]:
    """The trace's records, in timestamp order."""
    cfg = cfg or HeavyTailConfig()
    rng = np.random.default_rng(cfg.seed)
    B = cfg.block_tokens
    next_id = iter(range(1, 1 << 62))
    system = [next(next_id) for _ in range(cfg.system_blocks)]
    doc_pop = 1.0 / np.arange(1, cfg.docs + 1) ** cfg.doc_zipf
    doc_pop /= doc_pop.sum()
    doc_len = np.clip(np.rint(rng.lognormal(np.log(cfg.doc_blocks_median), 0.9, cfg.docs)),
                      1, cfg.max_blocks // 2).astype(int)
    doc_ids: dict[int, list[int]] = {}

    # chats start uniformly over the hour; each turn is one event (time, chat)
    turns: list[int] = []
    while sum(turns) < 1.3 * cfg.requests:          # chats ending early leave room
        turns.append(min(cfg.turns_max, int(rng.pareto(cfg.turns_alpha)) + 1))
    starts = np.sort(rng.uniform(0, cfg.duration_s, len(turns)))
    events: list[tuple[float, int, int]] = []
    for c, t in enumerate(starts):
        for k in range(turns[c]):
            events.append((t, c, k))
            t += cfg.think_s * (1.0 + rng.pareto(cfg.think_alpha))
    events.sort()

    chats: dict[int, _Chat | None] = {}
    records: list[dict] = []
    chat_ids = iter(range(1, 1 << 62))
    for t, c, k in events:
        if len(records) >= cfg.requests:
            break
        chat = chats.get(c)
        if k > 0 and chat is None:
            continue                       # the chat already ended (its context was full)
        if chat is None:
            prefix = list(system)
            if rng.random() < cfg.p_doc:
                d = int(rng.choice(cfg.docs, p=doc_pop))
                if d not in doc_ids:
                    doc_ids[d] = [next(next_id) for _ in range(int(doc_len[d]))]
                prefix += doc_ids[d]
            chat = _Chat(c, prefix, len(prefix) * B)
        kind = "text"
        user = int(max(1, rng.lognormal(np.log(cfg.user_tokens_median), cfg.user_sigma)))
        if chat.turn > 0:
            u = rng.random()
            if u < cfg.p_image:
                kind, user = "image", user + int(rng.choice([576, 729, 1024, 1280]))
            elif u < cfg.p_image + cfg.p_audio:
                kind, user = "audio", user + 1500
        n_in = chat.tokens + user
        if -(-n_in // B) > cfg.max_blocks:
            chats[c] = None
            continue
        while len(chat.full) < n_in // B:
            chat.full.append(next(next_id))
        ids = chat.full[: n_in // B] + ([next(next_id)] if n_in % B else [])
        n_out = int(max(1, rng.lognormal(np.log(cfg.output_tokens_median), cfg.output_sigma)))
        rid = next(chat_ids)
        records.append({"timestamp": int(t * 1000), "input_length": n_in, "output_length": n_out,
                        "hash_ids": ids, "type": kind, "chat_id": rid,
                        "parent_chat_id": chat.parent, "turn": chat.turn + 1})
        chat.tokens = n_in + n_out
        chat.parent = rid
        chat.turn += 1
        chats[c] = chat
    return records
