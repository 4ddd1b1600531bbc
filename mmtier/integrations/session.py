"""Old path, kept for configs written against it; the code lives in ``mmtier.engines.transformers.session``."""

from mmtier.engines.transformers.session import Media, Session, SessionResult  # noqa: F401
