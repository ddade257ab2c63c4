"""How much host memory a CPU replica may give its KV cache and decode slab.

The KV cache is mapped lazily (an idle replica's pages are not resident), so a
cache sized past what the container may hold works until the load is high and
long enough to touch it all; then the kernel's OOM killer ends the replica with
every request on it. So the CPU defaults (4 GiB of KV cache, 1 GiB of slab)
shrink to fit the memory the replica may use: the container's cgroup limit
(Kubernetes' ``resources.limits.memory``), else the machine's RAM, or
``--memory-limit-mib``. From 90 % of it come off what is resident once the model
is loaded and a reserve for a step's activations (prefill attention over long
contexts); the slab takes at most a quarter of the rest (more if the cache wants
less), the cache what is left.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

#: Of the memory limit, what the replica plans to use: the rest is slack for the
#: allocator's fragmentation and the kernel's own accounting.
LIMIT_SHARE = 0.9
#: Kept free for one step's temporaries: a 2,048-token prefill chunk attending over a
#: long context, the logits, gather buffers.
ACTIVATION_RESERVE_BYTES = 1 << 30
#: cgroup v1 writes "no limit" as a number near 2**63.
_NO_LIMIT = 1 << 60
MIB = 1 << 20


@dataclass(frozen=True)
class MemoryLimit:
    """The memory the replica may use, and who said so (for the log line)."""

    bytes: int
    source: str


def _own_cgroups(proc_cgroup: Path) -> tuple[str, str]:
    """This process's cgroup paths (v2, v1 memory) from ``/proc/self/cgroup``; "" when absent."""
    v2 = v1 = ""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return v2, v1
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":
            v2 = path.strip("/")
        elif "memory" in controllers.split(","):
            v1 = path.strip("/")
    return v2, v1


def container_memory_limit(
    cgroup_root: Path = Path("/sys/fs/cgroup"), proc_cgroup: Path = Path("/proc/self/cgroup")
) -> int | None:
    """The memory limit of this process's cgroup (v2 ``memory.max``, else v1
    ``memory.limit_in_bytes``); None if unlimited. Inside a container the cgroup is
    usually the mount's root; a service of systemd's (or a container without its own
    cgroup namespace) finds its own below it, as ``/proc/self/cgroup`` names it."""
    v2, v1 = _own_cgroups(proc_cgroup)
    candidates = [cgroup_root / v2 / "memory.max"] if v2 else []
    candidates.append(cgroup_root / "memory.max")
    if v1:
        candidates.append(cgroup_root / "memory" / v1 / "memory.limit_in_bytes")
    candidates.append(cgroup_root / "memory" / "memory.limit_in_bytes")
    for path in candidates:
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text == "max":
            return None
        try:
            value = int(text)
        except ValueError:
            continue
        return None if value >= _NO_LIMIT else value
    return None


def physical_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def memory_limit(
    limit_mib: int | None,
    cgroup_root: Path = Path("/sys/fs/cgroup"),
    proc_cgroup: Path = Path("/proc/self/cgroup"),
) -> MemoryLimit:
    """``--memory-limit-mib`` when given, else the container's limit, else the machine's RAM."""
    if limit_mib:
        return MemoryLimit(limit_mib * MIB, "--memory-limit-mib")
    container = container_memory_limit(cgroup_root, proc_cgroup)
    if container is not None:
        return MemoryLimit(min(container, physical_memory()), "the container's cgroup limit")
    return MemoryLimit(physical_memory(), "the machine's RAM")


@dataclass(frozen=True)
class CpuMemoryPlan:
    """Bytes for the KV cache and the decode slab, at most the configured ones."""

    kv_cache_bytes: int
    slab_bytes: int
    #: Bytes left for both after the limit's share, what is resident and the reserve.
    available_bytes: int


def plan_cpu_memory(
    limit: int,
    resident: int,
    kv_cache_wanted: int,
    slab_wanted: int,
    reserve: int = ACTIVATION_RESERVE_BYTES,
) -> CpuMemoryPlan:
    """Fit the KV cache and the slab in what the limit leaves; each gets at most what it wants."""
    available = max(0, int(limit * LIMIT_SHARE) - resident - reserve)
    # The slab copies K/V the cache already holds: a quarter at most, unless the cache
    # wants less than the rest.
    slab = min(slab_wanted, max(available // 4, available - kv_cache_wanted))
    return CpuMemoryPlan(min(kv_cache_wanted, available - slab), slab, available)
