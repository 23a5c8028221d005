"""The host-memory budget: how many streamed weight bytes stay in pinned RAM, the rest read
from the disk (schedules/tiers.py plans which; runtime/disk_reader.py reads them).

``host_memory_budget_mb`` counts the streamed weights kept pinned. Tables read in place and
the disk reads' staging ring are pinned besides it, and said at load. ``"auto"`` (the
default) takes ``AUTO_HOST_SHARE`` of the memory the system has available at load, less
those two: never more pinned memory than the machine can give, so a model larger than that
runs from the disk instead of failing in ``cudaHostRegister`` or pushing the system into swap.

Routed experts' tables are read in place too, and are most of an MoE checkpoint: where they
do not fit in that share besides the other tables and the streamed weights, they stay on disk
behind a host cache of experts (runtime/expert_store.py), which ``expert_host_cache_mb`` can
also size.
"""

from __future__ import annotations

import dataclasses

from hostswap.runtime.budget import AUTO, check_mb_argument
from hostswap.runtime.disk_reader import DiskReader
from hostswap.runtime.expert_store import HostExpertPlan, minimum_host_cache_bytes, plan_host_experts
from hostswap.runtime.host_memory import available_host_memory
from hostswap.runtime.ptd import PtdFile
from hostswap.schedules.experts import plan_expert_cache, resident_blocks
from hostswap.schedules.policies import PlannedLayout, lru_resident, plan_layout
from hostswap.schedules.tiers import TierPlan, plan_tiers, staging_bytes

# Of the memory available at load: the rest stays for the process itself (Python, torch, the
# program's host-side state), the page cache of whatever else runs, and other processes.
AUTO_HOST_SHARE = 0.75


def check_host_budget_argument(budget_mb) -> None:
    """Refuse what is neither ``"auto"`` nor a finite number of MB at or above 0."""
    check_mb_argument("host_memory_budget_mb", budget_mb, zero="every streamed weight from the disk")


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB"


@dataclasses.dataclass(frozen=True)
class HostBudget:
    """The host budget of a load, and the figures ``"auto"`` chose it from (None when given)."""

    budget_bytes: int
    available_bytes: int | None = None
    reserved_bytes: int = 0  # tables read in place and the largest staging ring, pinned besides

    def explain(self, tiers: TierPlan) -> str:
        if tiers.disk:
            where = (f"{len(tiers.disk)} streamed weights ({_mib(tiers.disk_bytes_per_forward)} a forward) are read from the disk, "
                     f"{len(tiers.pinned)} ({_mib(tiers.pinned_bytes)}) stay pinned; staging ring {_mib(tiers.staging_bytes)}")
        else:
            where = f"every streamed weight ({_mib(tiers.pinned_bytes)}) stays pinned, none is read from the disk"
        given = ("given" if self.available_bytes is None else
                 f"auto: {AUTO_HOST_SHARE:.0%} of {_mib(self.available_bytes)} available - {_mib(self.reserved_bytes)} for tables read in place and staging")
        return f"host budget {_mib(self.budget_bytes)} ({given}): {where}"


def _tables_bytes(schedule, aside: frozenset[str]) -> int:
    """Bytes of the tables read in place, those in ``aside`` left out."""
    return sum(n for f, n in zip(schedule.host_read, schedule.host_read_bytes) if f not in aside)


def host_budget(budget_mb, schedule, streamed: list[int], available_bytes: int | None = None, host_read_bytes: int | None = None) -> HostBudget:
    """The budget in bytes; for ``"auto"``, ``AUTO_HOST_SHARE`` of ``available_bytes`` (default:
    the system's, now) less the tables read in place (``host_read_bytes``, default every
    table's: less where experts are on disk) and the staging ring the largest streamed weight
    would need."""
    check_host_budget_argument(budget_mb)
    if budget_mb != AUTO:
        return HostBudget(round(budget_mb * 2**20))
    available = available_host_memory() if available_bytes is None else available_bytes
    tables = sum(schedule.host_read_bytes) if host_read_bytes is None else host_read_bytes
    reserved = tables + staging_bytes(schedule.weight_bytes[w] for w in streamed)
    return HostBudget(max(0, int(available * AUTO_HOST_SHARE) - reserved), available, reserved)


def plan_expert_host_tier(option, schedule, streamed: list[int], experts_on_device: frozenset[str] = frozenset(),
                          available_bytes: int | None = None) -> HostExpertPlan:
    """Whether the routed experts' tables (of the blocks not held whole on the device) stay
    pinned or on disk behind a host cache (runtime/expert_store.py). ``"auto"``: on disk where
    they do not fit in ``AUTO_HOST_SHARE`` of ``available_bytes`` (default: the system's, now)
    besides the other tables read in place, the staging ring and every streamed weight, which
    each token reads (where those leave less than one call's picks of every block, the
    streamed weights give way: what the share then lacks of them is read from the disk tier)."""
    blocks = tuple(b for b in schedule.expert_blocks if b.block not in experts_on_device)
    if option != AUTO or not blocks:
        return plan_host_experts(option, blocks, 0)
    available = available_host_memory() if available_bytes is None else available_bytes
    other_tables = _tables_bytes(schedule, frozenset(t for b in blocks for t in b.tables))
    # what host_budget leaves the streamed weights and the experts together
    share = int(available * AUTO_HOST_SHARE) - other_tables - staging_bytes(schedule.weight_bytes[w] for w in streamed)
    room = share - sum(schedule.weight_bytes[w] for w in streamed)
    least = minimum_host_cache_bytes(blocks)
    if room < least <= share:
        room = least
    return plan_host_experts(option, blocks, max(0, room))


def plan_host_tiers(budget_mb, schedule, layout: PlannedLayout | None, lru_budget_bytes: int = 0, expert_host_cache_mb="auto",
                    experts_on_device: frozenset[str] = frozenset(), available_bytes: int | None = None) -> tuple[HostBudget, TierPlan, HostExpertPlan]:
    """The host budget, every weight's tier under it, and the routed experts' host tier.
    ``layout``: the planned policy's (None: the lru policy at ``lru_budget_bytes``, which
    streams every weight it does not keep resident from pinned memory and has no disk tier).
    ``experts_on_device``: MoE blocks whose tables the device holds whole. ``available_bytes``:
    the RAM available, for ``"auto"`` (default: the system's, read once, now)."""
    resident = layout.resident if layout is not None else frozenset(lru_resident(schedule, lru_budget_bytes))
    streamed = [w for w in range(len(schedule.fqns)) if w not in resident]
    if available_bytes is None and AUTO in (budget_mb, expert_host_cache_mb):
        available_bytes = available_host_memory()
    experts = plan_expert_host_tier(expert_host_cache_mb, schedule, streamed, experts_on_device, available_bytes)
    # the tables pinned: the others, and the experts' tables or their host slots
    host_read_bytes = _tables_bytes(schedule, experts.tables) + experts.pinned_bytes
    budget = host_budget(budget_mb, schedule, streamed, available_bytes, host_read_bytes=host_read_bytes)
    if layout is not None:
        return budget, dataclasses.replace(plan_tiers(schedule, layout, budget.budget_bytes), host_read_bytes=host_read_bytes), experts
    nbytes = schedule.weight_bytes
    streamed_bytes = sum(nbytes[w] for w in streamed)
    if streamed_bytes > budget.budget_bytes:
        raise ValueError(f"policy='lru' streams every weight from pinned host memory ({_mib(streamed_bytes)}); host_memory_budget_mb="
                         f"{budget.budget_bytes / 2**20:.1f} is less. Use policy='planned', which reads what does not fit from the disk")
    return budget, TierPlan(resident=resident, pinned=frozenset(streamed), disk=frozenset(), disk_fills=(), host_budget_bytes=budget.budget_bytes,
                            pinned_bytes=streamed_bytes, host_read_bytes=host_read_bytes, staging_bytes=0,
                            disk_bytes_per_forward=0, pinned_bytes_per_forward=sum(nbytes[w] for w in schedule.probe_weight if w not in resident)), experts


def plan_placement(schedule, budget_bytes: int, planned: bool, host_budget_mb, expert_host_cache_mb="auto", available_bytes: int | None = None):
    """What a load places where under a device budget of ``budget_bytes`` (the pool's and the
    resident experts'): the planned layout (None where ``planned`` is false: the lru policy),
    and ``plan_host_tiers``' host budget, tiers and experts' host tier, the MoE blocks the
    budget holds whole on the device left out of the host's."""
    layout = plan_layout(schedule, budget_bytes) if planned else None
    blocks = schedule.expert_blocks
    on_device = resident_blocks(plan_expert_cache(blocks, budget_bytes - schedule.resident_bytes), blocks)
    return (layout, *plan_host_tiers(host_budget_mb, schedule, layout, budget_bytes, expert_host_cache_mb, on_device, available_bytes))


def open_disk_reader(ptd: PtdFile, schedule, tiers: TierPlan, device) -> DiskReader | None:
    """The reader of ``tiers``' disk fills from ``ptd`` (None without a disk tier), its staging
    registered with CUDA for a CUDA ``device``."""
    pinned = device.type == "cuda"
    if not tiers.disk:
        return None
    entries = [ptd.entries[schedule.fqns[schedule.probe_weight[q]]] for q in tiers.disk_fills]
    return DiskReader(ptd, [(e.fqn, e.offset, e.nbytes) for e in entries], tiers.staging_bytes, pinned=pinned, device=device)
