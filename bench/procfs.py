"""What /proc says of this process, and dropping files from the page cache: the benchmarks'
shared view of host memory and of the disk (standard library only, so a peer's process that
imports it carries nothing of hostswap's)."""

from __future__ import annotations

import os


def memory() -> dict:
    """This process's RSS now and its peak, in bytes, from ``/proc/self/status`` (None where it
    has none). Not ``ru_maxrss``: a process started by exec inherits its parent's peak there
    (Linux carries the old memory map's high-water mark over the exec), so a child of a large
    parent reads the parent's."""
    try:
        with open("/proc/self/status") as f:
            fields = {key: int(rest.split()[0]) * 1024 for key, _, rest in (line.partition(":") for line in f) if key in ("VmRSS", "VmHWM")}
    except OSError:
        fields = {}
    return {"rss": fields.get("VmRSS"), "peak": fields.get("VmHWM")}


def drop_page_cache(*paths: str) -> int:
    """Write back and evict from the page cache each file given, and each regular file of each
    folder given (no root needed); returns their bytes."""
    os.sync()
    files = []
    for path in paths:
        if os.path.isdir(path):
            files += [os.path.join(path, n) for n in sorted(os.listdir(path)) if os.path.isfile(os.path.join(path, n))]
        else:
            files.append(path)
    total = 0
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            total += os.fstat(fd).st_size
        finally:
            os.close(fd)
    return total
