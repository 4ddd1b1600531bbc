"""The demos: ``serving`` (the OpenAI path through Ray Serve LLM and vLLM, the default) and ``chat`` (the transformers chat model in a ChatEngine actor), and their report."""
