"""Telemetry leaves: a one-line description of the machine figures and reports come from."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def machine() -> str:
    """Cores, CPU model, memory and (when present) the GPU, in one line."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = ""
    try:
        kb = int(Path("/proc/meminfo").read_text().split()[1])
        mem = f", {kb / (1 << 20):.0f} GiB"
    except (OSError, ValueError, IndexError):
        pass
    desc = f"{os.cpu_count()} cores {cpu}{mem}"
    try:
        import torch

        if torch.cuda.is_available():
            desc += f", {torch.cuda.get_device_name(0)}"
    except ImportError:
        pass
    return desc
