"""The harnesses, fixtures and scenarios the tests share (no tests here)."""
