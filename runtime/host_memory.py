"""The host RAM a process can take: one reading of it, shared by every budget that counts it
(the pinned host tier, and the weight budget of a program run on the CPU).

The kernel's ``MemAvailable`` counts the page cache it can drop; free pages alone do not, and
after a checkpoint is read most of the RAM is page cache. A container's cgroup may allow less.
"""

from __future__ import annotations

import os


def available_host_memory() -> int:
    """RAM this process can have without swapping or its cgroup's OOM killer: ``MemAvailable``
    (free pages where there is none), less where a cgroup (a container) allows less."""
    available = None
    try:
        with open("/proc/meminfo") as f:
            available = next((int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")), None)
    except OSError:
        pass
    if available is None:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    room = cgroup_room(_read("/proc/self/cgroup"), _read)
    return available if room is None else min(available, room)


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def cgroup_room(self_cgroup: str | None, read) -> int | None:
    """Bytes the process's cgroup (``self_cgroup``: /proc/self/cgroup) lets it still take, its
    limit less its usage, from ``read(path)`` (text, or None where absent); None without a limit.
    cgroup v2 (``memory.max``), else v1's memory controller (``memory.limit_in_bytes``); in a
    container the process's own path may not be mounted, and the mount's root is its cgroup."""
    if not self_cgroup:
        return None
    for line in self_cgroup.splitlines():
        number, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if number == "0" and not controllers:
            root, files = "/sys/fs/cgroup", ("memory.max", "memory.current")
        elif "memory" in controllers.split(","):
            root, files = "/sys/fs/cgroup/memory", ("memory.limit_in_bytes", "memory.usage_in_bytes")
        else:
            continue
        for folder in dict.fromkeys((root + path.rstrip("/"), root)):
            limit, usage = read(f"{folder}/{files[0]}"), read(f"{folder}/{files[1]}")
            if limit and usage:
                if limit.strip() == "max" or int(limit) >= 2**60:  # v1 writes "no limit" as a near-2**63 number
                    return None
                return max(0, int(limit) - int(usage))
    return None
