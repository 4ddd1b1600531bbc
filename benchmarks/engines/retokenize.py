"""How much of a previous answer's generated token ids the next turn's prompt repeats after a
chat template renders the history again (tokenizers only, no engine).

``python -m benchmarks.engines.retokenize [--out DIR]``

A cache keyed by token ids (mmtier's decode saves, vLLM's own prefix cache) reuses the previous
answer's KV only as far as the next prompt's ids equal the generated ones, position by
position after the previous prompt. Per tokenizer and template: turn 1's prompt (user message,
generation prompt), an answer's ids as the model emitted them, turn 2's prompt (user, assistant
= the answer's text, user); the share of the answer's ids (its end-of-sequence token not
counted) that turn 2 repeats from turn 1's prompt's end, and where the ids part.

- The tiny random-weight models the project serves (``mmtier.serve.tiny_models``: the demo's
  and serve's LLaVA; ``tiny_video``: Qwen2-VL; ``tiny_audio``: Qwen2-Audio) share a word-level
  tokenizer (their own specials apart) and a template that joins messages' text a line each;
  English text is all ``<unk>`` to them, so their answers are what such a model emits: ids
  drawn uniformly from the vocabulary (specials included, EOS not: it ends an answer),
  detokenized as vLLM's OpenAI server does (``skip_special_tokens``): a special token the
  model generated is not in the text, so the next prompt parts from the answer there.
- A Llama-style text model: the engine tests' tiny Llama has no tokenizer (its prompts are ids),
  so the real Llama-family SentencePiece vocabulary that vLLM's dependency ``mistral_common``
  ships (``tokenizer.model.v1``, Mistral 7B v0.1's 32000 tokens) under Llama-2-chat's template
  (which strips messages), and ``mistral_common``'s own chat encoding (vLLM's
  ``tokenizer_mode=mistral``) for its SentencePiece v3 and Tekken vocabularies. Their answers
  are realistic texts (``ANSWERS``: paragraphs, code with blank lines, lists, a table, JSON, an
  answer opening with a newline, one closing with one), each token ids as the tokenizer encodes
  it whole: a model emits about that, though a sampled answer can take a non-canonical
  split this does not show.

No Qwen3 or other hub tokenizer is here (no hub access): Qwen3's dropping of earlier
``<think>`` blocks is not measured."""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
from collections import Counter
from pathlib import Path

from benchmarks._common import RESULTS, add_out_arg, write_results

QUESTIONS = ["Can you explain how the cache works?", "Write the function for me.",
             "What should I check first?", "Summarize the results."]

ANSWERS = [
    "Sure. The cache keeps the key and value tensors of every token it has seen, grouped in "
    "blocks of 32 positions.\nWhen a new prompt arrives, it looks up the longest run of blocks "
    "whose tokens match, and only the rest is computed again.\n\nThis matters most in long "
    "conversations: each turn repeats the whole history, so without the cache the model would "
    "recompute thousands of tokens before writing a single word.",
    "Here is a version that reads the file in chunks:\n\n```python\ndef checksum(path, size=1 << 20):\n"
    "    h = hashlib.sha256()\n    with open(path, \"rb\") as f:\n        while chunk := f.read(size):\n"
    "            h.update(chunk)\n    return h.hexdigest()\n\n\ndef main():\n    print(checksum(sys.argv[1]))\n"
    "```\n\nIt never holds more than one chunk in memory, so it works for files larger than RAM.",
    "A few things to check, in order:\n\n1. The service is running: `systemctl status app`.\n"
    "2. The port is open (8000 by default).\n3. The logs show no errors in the last hour.\n\n"
    "- If the first fails, restart it.\n- If the second fails, look at the firewall rules.\n"
    "- Otherwise, send me the log lines around the first error.",
    "| Model | Tokens/s | Memory |\n|-------|---------:|-------:|\n| small | 1,240 | 2.1 GB |\n"
    "| large | 310 | 14.8 GB |\n\nThe large model is about 4x slower but uses 7x the memory; for "
    "most chats the small one answers well enough.",
    "The request returns:\n\n```json\n{\n  \"id\": \"chat-42\",\n  \"choices\": [\n    {\"index\": 0, "
    "\"finish_reason\": \"stop\"}\n  ],\n  \"usage\": {\"prompt_tokens\": 812, \"completion_tokens\": 96}\n}\n"
    "```\n\nNote that `usage` counts the prompt's tokens, including the whole history.",
    "\nIn short: the first turn costs the most, and every later turn is cheap as long as its "
    "history stays cached. Eviction is what breaks this, so size the cache for the number of "
    "conversations you keep open at once.",
    "Results, per run:\n\n* run 1: 0.93 accuracy, 41 s\n* run 2: 0.95 accuracy, 39 s\n* run 3: "
    "0.94 accuracy, 40 s\n\nThe spread is within noise; I would report the median (0.94).\n",
    "Yes — café, naïve and 東京 are all encoded byte by byte where the vocabulary lacks them, "
    "which makes such words longer in tokens than in characters. Emoji 🙂 are the worst case.",
]

LLAMA2_TEMPLATE = (  # Llama-2-chat's published template, its user / assistant part: messages stripped
    "{% for message in messages %}{% if message['role'] == 'user' %}"
    "{{ bos_token + '[INST] ' + message['content'].strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + message['content'].strip() + ' ' + eos_token }}"
    "{% endif %}{% endfor %}")


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def measure(turn1, turn2, answers: list[tuple[str, list[int]]], piece) -> dict:
    """``turn1(question) -> ids``, ``turn2(question, answer_text, next) -> ids``; ``answers``:
    (text as the server returns it, generated ids); ``piece(id) -> str`` to say where ids part."""
    shares, parts, prompt_piece, prefix_ok = [], Counter(), {}, True
    for i, (text, gen) in enumerate(answers):
        q = QUESTIONS[i % len(QUESTIONS)]
        p1, p2 = turn1(q), turn2(q, text, QUESTIONS[(i + 1) % len(QUESTIONS)])
        prefix_ok &= p2[:len(p1)] == p1
        rest = p2[len(p1):] if p2[:len(p1)] == p1 else []
        n = common_prefix(gen, rest)
        shares.append(n / len(gen))
        if n < len(gen):
            where = "start" if n == 0 else "end" if n == len(gen) - 1 else "inside"
            key = f"{where}, generated {piece(gen[n])!r}"
            parts[key] += 1
            prompt_piece.setdefault(key, piece(rest[n]) if n < len(rest) else "nothing")
    return {"answers": len(answers), "median_share": statistics.median(shares), "min_share": min(shares),
            "whole": sum(s == 1.0 for s in shares), "prompt_is_prefix": prefix_ok,
            "parts": "; ".join(f"{k} -> prompt {prompt_piece[k]!r} (x{v})" for k, v in parts.most_common(3)) or "never"}


def tiny(specials: list[str], template: str, n: int, length: int) -> dict:
    """A tiny model's word-level tokenizer: random ids as its random weights emit them."""
    from mmtier.serve.tiny_models import build_tokenizer

    tok = build_tokenizer(specials)
    tok.chat_template = template
    rng = random.Random(0)
    ids = [i for i in range(len(tok)) if i != tok.eos_token_id]   # a sampled EOS ends the answer
    answers = []
    for _ in range(n):
        gen = [rng.choice(ids) for _ in range(length)]
        answers.append((tok.decode(gen, skip_special_tokens=True), gen))

    return _measure_template(tok, answers)


def _measure_template(tok, answers: list) -> dict:
    """``measure`` with ``tok``'s chat template: turn 1 a user message, turn 2 the history with
    the decoded answer and a new user message."""
    def chat(msgs):
        return _ids(tok.apply_chat_template(msgs, add_generation_prompt=True))
    return measure(lambda q: chat([{"role": "user", "content": q}]),
                   lambda q, a, q2: chat([{"role": "user", "content": q}, {"role": "assistant", "content": a},
                                          {"role": "user", "content": q2}]),
                   answers, lambda t: tok.convert_ids_to_tokens(t))


def _ids(out) -> list[int]:
    return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)


def llama2(model_file: Path) -> dict:
    """The Llama-family SentencePiece vocabulary under Llama-2-chat's template (transformers)."""
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "tokenizer.model").write_bytes(model_file.read_bytes())
        (Path(d) / "tokenizer_config.json").write_text(
            '{"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", '
            '"unk_token": "<unk>", "legacy": false}')
        tok = AutoTokenizer.from_pretrained(d)
    tok.chat_template = LLAMA2_TEMPLATE
    answers = [(a, tok.encode(a, add_special_tokens=False)) for a in ANSWERS]

    return _measure_template(tok, answers)


def mistral(model_file: Path) -> dict:
    """``mistral_common``'s own chat encoding (vLLM's ``tokenizer_mode=mistral``)."""
    from mistral_common.protocol.instruct.messages import AssistantMessage, UserMessage
    from mistral_common.protocol.instruct.request import ChatCompletionRequest
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

    tok = MistralTokenizer.from_file(str(model_file))
    inner = tok.instruct_tokenizer.tokenizer
    answers = [(a, inner.encode(a, bos=False, eos=False)) for a in ANSWERS]

    def chat(msgs):
        return list(tok.encode_chat_completion(ChatCompletionRequest(messages=msgs)).tokens)
    return measure(lambda q: chat([UserMessage(content=q)]),
                   lambda q, a, q2: chat([UserMessage(content=q), AssistantMessage(content=a), UserMessage(content=q2)]),
                   answers, lambda t: inner.id_to_piece(t))


def run(n_tiny: int = 50, length: int = 128) -> list[tuple[str, str, dict]]:
    import mistral_common

    from mmtier.serve.tiny_audio import AUDIO_SPECIALS
    from mmtier.serve.tiny_models import CHAT_TEMPLATE, SPECIALS
    from mmtier.serve.tiny_video import VIDEO_SPECIALS

    data = Path(mistral_common.__file__).parent / "data"
    line = "one line per message, joined"
    return [
        ("tiny_llava", f"tiny LLaVA (demo, serve): {line}", tiny(SPECIALS, CHAT_TEMPLATE, n_tiny, length)),
        ("tiny_qwen2_vl", f"tiny Qwen2-VL: {line}", tiny(VIDEO_SPECIALS, CHAT_TEMPLATE, n_tiny, length)),
        ("tiny_qwen2_audio", f"tiny Qwen2-Audio: {line}",
         tiny(AUDIO_SPECIALS, CHAT_TEMPLATE, n_tiny, length)),
        ("llama_sp_llama2", "Llama SentencePiece (32000): Llama-2-chat, stripped", llama2(data / "tokenizer.model.v1")),
        ("mistral_v1", "Llama SentencePiece (32000): mistral_common v1",
         mistral(data / "tokenizer.model.v1")),
        ("mistral_v3", "Mistral SentencePiece v3 (32768): mistral_common",
         mistral(data / "mistral_instruct_tokenizer_240323.model.v3")),
        ("mistral_tekken", "Mistral Tekken (131072): mistral_common", mistral(data / "tekken_240911.json")),
    ]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_out_arg(ap)
    ap.add_argument("--tiny-answers", type=int, default=50, help="random answers per tiny model")
    ap.add_argument("--length", type=int, default=128, help="tokens of a tiny model's answer")
    args = ap.parse_args(argv)
    rows = run(args.tiny_answers, args.length)
    print(f"\n{'tokenizer and template':<55} {'answers':>7} {'median':>7} {'min':>5} {'whole':>5}  where the ids part")
    figures: dict = {"tiny_answer_tokens": args.length, "realistic_answers": len(ANSWERS)}
    for key, label, r in rows:
        print(f"{label:<55} {r['answers']:>7} {r['median_share']:>7.3f} {r['min_share']:>5.2f} "
              f"{r['whole']:>5}  {r['parts']}")
        figures.update({f"{key}_{k}": v for k, v in r.items()})
        figures[f"{key}_label"] = label
    print("\nshare: of the previous answer's generated ids (EOS not counted), those the next prompt repeats "
          "from the previous prompt's end; whole: answers repeated whole")
    print("wrote", write_results("retokenize", figures, args.out or RESULTS))


if __name__ == "__main__":
    main()
