"""Where each weight lives between runs of its kernels: the GPU, pinned host memory, or the disk.

The planned policy fixes which weights stay on the GPU (``policies.plan_layout``); the others
are copied to the GPU each time their fill comes round. This plan splits those streamed
weights between two sources, within ``host_budget_bytes`` of pinned host memory:

- **pinned**: the ``.ptd``'s pages of the weight are registered with the driver and stay in
  RAM; its copy is one asynchronous DMA from the mapping;
- **disk**: the weight is read from the ``.ptd`` each time it is filled, into a ring of
  pinned staging memory, by reader threads running ahead of the copy stream in the static
  fill order; its pages are never mapped in.

Tables that row gathers read in place (``schedule.host_read``) are pinned whatever the budget:
a gather reads them over the bus, and there is no copy to feed from the disk. The staging ring
holds ``STAGING_READS`` of the largest disk read, so that many reads are in flight while the
copies drain the oldest.

Every forward reads the same disk bytes whichever streamed weights are pinned, so the choice
sizes the staging ring and spreads the reads. Weights larger than every other are pinned first
where the budget holds them (the staging ring then follows the layers' size, not a head's);
the rest are picked evenly along the fill order (the share of disk bytes stays level), so that
the reader and the link overlap over the whole forward instead of the reader lagging through
one stretch of disk weights.
"""

from __future__ import annotations

import dataclasses

from hostswap.schedules.policies import PlannedLayout
from hostswap.schedules.schedule_facts import ScheduleFacts

# O_DIRECT needs file offsets, lengths and buffers aligned to the device's logical block;
# 4096 covers every block size in use.
DIRECT_ALIGNMENT = 4096
# Reads the staging ring holds at once, each as large as the largest disk weight.
STAGING_READS = 4


def read_span(nbytes: int) -> int:
    """The most bytes an aligned read of an ``nbytes`` weight at any offset covers."""
    return -(-(nbytes + DIRECT_ALIGNMENT - 1) // DIRECT_ALIGNMENT) * DIRECT_ALIGNMENT


def staging_bytes(weight_bytes) -> int:
    """The staging ring for disk reads of weights of these sizes (0 for none)."""
    return STAGING_READS * max((read_span(n) for n in weight_bytes), default=0)


@dataclasses.dataclass(frozen=True)
class TierPlan:
    """Every weight's tier, the disk reads of a forward in fill order, and the host memory used."""

    resident: frozenset[int]  # on the GPU for the program's lifetime
    pinned: frozenset[int]  # streamed from pinned pages of the mapping
    disk: frozenset[int]  # streamed from the file through the staging ring
    disk_fills: tuple[int, ...]  # fill probes of disk weights, in order: what the reader reads, cyclically
    host_budget_bytes: int
    pinned_bytes: int  # streamed weights kept pinned
    host_read_bytes: int  # tables read in place (pinned whatever the budget)
    staging_bytes: int  # the disk reads' ring (0 without a disk tier)
    disk_bytes_per_forward: int
    pinned_bytes_per_forward: int  # streamed from pinned pages each forward

    @property
    def host_pinned_bytes(self) -> int:
        """Host memory this plan pins: pinned weights, tables read in place, staging."""
        return self.pinned_bytes + self.host_read_bytes + self.staging_bytes

    def tier_of(self, weight: int) -> str:
        return "gpu" if weight in self.resident else "host" if weight in self.pinned else "disk"


def plan_tiers(schedule: ScheduleFacts, layout: PlannedLayout, host_budget_bytes: int) -> TierPlan:
    """Split the weights ``layout`` streams between pinned host memory (at most
    ``host_budget_bytes`` of weight bytes) and the disk, spreading the disk bytes evenly."""
    if host_budget_bytes < 0:
        raise ValueError(f"the host memory budget must not be negative, got {host_budget_bytes} bytes")
    fills = sorted(layout.fill_offset)
    order: list[int] = []  # streamed weights by first fill
    for q in fills:
        w = schedule.probe_weight[q]
        if w not in order:
            order.append(w)
    nbytes = schedule.weight_bytes
    total = sum(nbytes[w] for w in order)
    pinned: set[int] = set()
    if total <= host_budget_bytes:
        pinned = set(order)
    else:
        # The staging ring holds reads of the largest disk weight: pin every weight above the
        # smallest size cap whose larger weights the budget holds (a head far larger than the
        # layers then stays in RAM, and staging follows the layers' size).
        cap = max(nbytes[w] for w in order)
        for size in sorted({nbytes[w] for w in order}, reverse=True)[1:]:
            if sum(nbytes[w] for w in order if nbytes[w] > size) > host_budget_bytes:
                break
            cap = size
        pinned = {w for w in order if nbytes[w] > cap}
        used = sum(nbytes[w] for w in pinned)
        rest = [w for w in order if w not in pinned]
        share, level, seen = (host_budget_bytes - used) / sum(nbytes[w] for w in rest), 0, 0
        for w in rest:  # level: the rest's pinned bytes follow the budget's share of its bytes so far
            seen += nbytes[w]
            if level + nbytes[w] <= share * seen:
                pinned.add(w)
                level += nbytes[w]
        used += level
        for w in order:  # then what the rounding left room for
            if w not in pinned and used + nbytes[w] <= host_budget_bytes:
                pinned.add(w)
                used += nbytes[w]
    disk = [w for w in order if w not in pinned]
    disk_fills = tuple(q for q in fills if schedule.probe_weight[q] not in pinned)
    staging = staging_bytes(nbytes[w] for w in disk)
    return TierPlan(
        resident=frozenset(layout.resident), pinned=frozenset(pinned), disk=frozenset(disk), disk_fills=disk_fills,
        host_budget_bytes=host_budget_bytes, pinned_bytes=sum(nbytes[w] for w in pinned),
        host_read_bytes=sum(schedule.host_read_bytes), staging_bytes=staging,
        disk_bytes_per_forward=sum(nbytes[schedule.probe_weight[q]] for q in disk_fills),
        pinned_bytes_per_forward=sum(nbytes[schedule.probe_weight[q]] for q in fills if schedule.probe_weight[q] in pinned),
    )
