"""Memory probes of the benchmark: the host's peak resident set (resettable on Linux), the
device's peak, and the bytes of a parameter tree."""
from __future__ import annotations

import re
import sys
from pathlib import Path


def reset_peak_rss() -> bool:
    """Restart the kernel's resident-set high-water mark (Linux); False where that is impossible."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    """VmHWM (since the last reset) where /proc has it, else getrusage's lifetime max RSS."""
    try:
        found = re.search(r"VmHWM:\s+(\d+) kB", Path("/proc/self/status").read_text())
        if found:
            return int(found.group(1)) * 1024
    except OSError:
        pass
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, kB elsewhere


def device_peak_bytes() -> int | None:
    import jax

    stats = jax.devices()[0].memory_stats()  # None on CPU
    return None if not stats else stats.get("peak_bytes_in_use")


def tree_bytes(tree) -> int:
    import jax

    return sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(tree))
