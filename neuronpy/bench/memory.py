"""The process's memory around a run: peak RSS (reset where Linux allows) and CUDA's peak
allocation."""

from __future__ import annotations

import re
import resource
import sys


def _status_kb(field_name: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            match = re.search(rf"^{field_name}:\s+(\d+) kB", f.read(), re.M)
    except OSError:
        return None
    return int(match.group(1)) if match else None


def reset_peak_rss() -> bool:
    """Resets this process's peak RSS (Linux: /proc/self/clear_refs); False where it can't."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def rss_mb() -> float | None:
    kb = _status_kb("VmRSS")
    return kb / 1024 if kb is not None else None


def reset_device_peak() -> None:
    """Resets CUDA's peak-allocation counter, where CUDA is in use."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.reset_peak_memory_stats()


def device_peak_mb() -> float | None:
    """Peak CUDA memory allocated by PyTorch since the last reset; None without CUDA."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.max_memory_allocated() / (1024 * 1024)
    return None


def peak_rss_mb() -> float:
    """Peak RSS since the last reset (VmHWM), else the process's lifetime peak (getrusage)."""
    kb = _status_kb("VmHWM")
    if kb is not None:
        return kb / 1024
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1024 * 1024) if sys.platform == "darwin" else peak / 1024
