"""mmtier's own multimodal chat app, in one place: a Qwen2-VL decoder with its vision tower and
Whisper for audio over one cache through the transformers adapter (``model``: ``ChatModel``),
its conversations (``conversation``: a turn attaches the history's groups and prefills only its
new tokens), their history replay and keys (``history``, ``spans``), its media items
(``media``: images, video segments, audio clips, byte-level text ids), the dense reference
(``dense``: the same conversation recomputed with no reuse) and the engine actor that holds a
pool (``actor``: ``ChatEngine``). Served by ``mmtier.serve`` (``chat_model``), run by
``mmtier demo --engine transformers``. The engines it builds on are ``mmtier.engines``'.
"""
