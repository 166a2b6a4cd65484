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


def cache_bytes_per_token(spec) -> int:
    """Bytes a target's decode cache (`TargetSpec.init_cache`) grows by per token of one row: its KV
    cache's keys and values, a latent cache's latent and rotary key (multi-head latent attention);
    a hybrid's recurrent states do not grow. From shapes only, nothing allocated."""
    import jax

    size = lambda capacity: tree_bytes(jax.eval_shape(lambda: spec.init_cache(1, capacity)))  # noqa: E731
    return size(2) - size(1)
