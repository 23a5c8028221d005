"""Routed experts read from the disk, through a cache of experts in pinned host memory.

An MoE checkpoint is mostly expert tables, and the largest do not fit in the RAM of the
machine that runs them. Where a block's tables cannot stay pinned (``plan_host_experts``),
they stay in the ``.ptd`` on disk and the block gets ``slots`` experts of pinned host memory
instead (``HostExpertCache``). A call of the block learns its picks on the host (experts on
disk are read by the host: one sync per block and call), brings those the slots lack from
the file into the slots the policy evicts (``HostSlots``: the experts asked for least often
lately by default, as the device caches evict), and its products read them from there
(kernels/routed_experts.py), through the block's device cache where it has one. A forward
with experts on disk runs eagerly, as one with any weight on disk does.

Reads go to a few threads in chunks (``ExpertReader``), ``O_DIRECT`` where the file takes it
(the page cache would fill RAM with the very bytes the budget keeps out of it): a table's
slots start at the offset within a block of the disk that its rows start at in the file, so
each row's aligned middle is read straight into its slot and only the partial blocks at its
two ends go through the page cache, dropped after each read. Rows whose size is not a whole
number of blocks are read buffered.
A slot is refilled only once the kernels that read it last have completed (an event per call).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import mmap
import os
import time

import torch

from hostswap.runtime.budget import AUTO, check_mb_argument
from hostswap.runtime.disk_reader import CHUNK_BYTES, READER_THREADS, open_for_reads, pread_into
from hostswap.runtime.expert_cache import DEFAULT_POLICY, HALF_LIFE, check_policy, ranks_by_uses
from hostswap.runtime.ptd import PtdFile, device_view_of, file_identity, register_host_memory, unregister_host_memory
from hostswap.schedules.artifacts import ArtifactError
from hostswap.schedules.experts import ExpertBlock, plan_expert_cache
from hostswap.schedules.tiers import DIRECT_ALIGNMENT


def check_expert_host_cache_argument(value) -> None:
    """Refuse what is neither ``"auto"`` nor a finite number of MB above 0."""
    check_mb_argument("expert_host_cache_mb", value)


@dataclasses.dataclass(frozen=True)
class HostExpertPlan:
    """Where the routed experts' tables live on the host: pinned whole (``slots`` empty), or on
    disk behind ``slots`` experts of pinned host memory per block."""

    slots: dict[str, int]
    tables: frozenset[str]  # the FQNs of the blocks' tables
    table_bytes: int  # every block's tables
    cache_bytes: int  # the host slots' bytes (0 when the tables are pinned)
    room_bytes: int | None  # what the choice was made from (None: given)

    @property
    def on_disk(self) -> bool:
        return bool(self.slots)

    @property
    def disk_tables(self) -> frozenset[str]:
        """The tables left in the ``.ptd`` (none when they are pinned)."""
        return self.tables if self.on_disk else frozenset()

    @property
    def pinned_bytes(self) -> int:
        """Host memory the experts take: their tables, or the slots."""
        return self.cache_bytes if self.on_disk else self.table_bytes

    def explain(self, policy: str | None = None) -> str:
        """Where the tables are, and for slots how many per block and (``policy`` given) how they evict."""
        if not self.on_disk:
            return f"expert tables pinned whole ({self.table_bytes / 2**20:.1f} MiB)"
        per_block = sorted(set(self.slots.values()))
        where = "given" if self.room_bytes is None else f"auto: {self.room_bytes / 2**20:.1f} MiB of host memory left for them"
        return (f"expert tables ({self.table_bytes / 2**20:.1f} MiB) read from the disk through {self.cache_bytes / 2**20:.1f} MiB of pinned host "
                f"slots ({'/'.join(map(str, per_block))} experts per block{'' if policy is None else ', evicting ' + policy}; {where})")


def minimum_host_cache_bytes(blocks) -> int:
    """The fewest host bytes experts on disk need: one call's picks of every block, in slots of
    the same number per block (``plan_expert_cache``), so the largest top-k in each."""
    least = max((min(b.top_k, b.num_experts) for b in blocks), default=0)
    return sum(min(least, b.num_experts) * b.unit_bytes for b in blocks)


def plan_host_experts(option, blocks: tuple[ExpertBlock, ...], room_bytes: int) -> HostExpertPlan:
    """The experts' host tier. ``option`` ``"auto"``: the tables stay pinned where ``room_bytes``
    (the host memory left for them at load) holds them, else slots in that room; a number of
    MB: slots of that size (the tables pinned whole where it holds them). Slots are the same
    number per block, at least its top-k: a smaller figure is refused, naming the least."""
    check_expert_host_cache_argument(option)
    table_bytes = sum(b.table_bytes for b in blocks)
    tables = frozenset(t for b in blocks for t in b.tables)
    given = None if option == AUTO else round(option * 2**20)
    room = room_bytes if given is None else given
    if not blocks or room >= table_bytes:
        return HostExpertPlan({}, tables, table_bytes, 0, room_bytes if given is None else None)
    least = minimum_host_cache_bytes(blocks)
    slots = plan_expert_cache(blocks, room)
    if room < least or any(slots[b.block] < min(b.top_k, b.num_experts) for b in blocks):
        what = (f"expert_host_cache_mb={option}" if given is not None else
                f"the host memory left for them at load ({room_bytes / 2**20:.1f} MiB)")
        raise ValueError(f"the routed experts' tables ({table_bytes / 2**20:.1f} MiB) do not fit in pinned host memory and {what} holds fewer "
                         f"than one call's picks of every block; experts read from the disk need at least {least / 2**20:.1f} MiB "
                         f"of host slots (expert_host_cache_mb)")
    cache = sum(slots[b.block] * b.unit_bytes for b in blocks)
    return HostExpertPlan(slots, tables, table_bytes, cache, room_bytes if given is None else None)


class HostSlots:
    """Which expert each of a host cache's slots holds, and which slots the experts a call
    lacks take: an empty slot first, then the one ``policy`` evicts (``POLICIES`` of
    runtime/expert_cache.py, counted as the device caches count: each call adds one per
    expert it asks for, and every ``half_life`` calls the counts are halved), never a slot
    holding another expert of the same call. Plain host bookkeeping, apart from the reads."""

    def __init__(self, slots: int, num_experts: int, policy: str = DEFAULT_POLICY, half_life: int = HALF_LIFE):
        check_policy(policy)
        self.slots, self.policy, self.half_life = slots, policy, int(half_life)
        self.by_uses = ranks_by_uses(policy)
        self.expert_of = [-1] * slots  # -1: empty
        self.slot_of: dict[int, int] = {}
        self.uses = [0] * num_experts  # asked for lately, held or not
        self.last_use = [0] * slots
        self.clock = 0

    def place(self, experts: list[int]) -> tuple[list[int], list[tuple[int, int]]]:
        """Count a call of ``experts`` (distinct) and give each a slot: (the slot of each, the
        (expert, slot) pairs to be read in). The slots those take are empty until ``filled``
        (a read that fails leaves them empty, the first to be taken again)."""
        self.clock += 1
        if self.clock % self.half_life == 0:
            self.uses = [u >> 1 for u in self.uses]
        for e in experts:
            self.uses[e] += 1
        missed = [e for e in experts if e not in self.slot_of]
        held = {self.slot_of[e] for e in experts if e in self.slot_of}
        victims = sorted((s for s in range(self.slots) if s not in held), key=self._evicted_before)[: len(missed)]
        for s in victims:  # emptied before the map forgets it: an interrupt between leaves no slot named for bytes it lacks
            old, self.expert_of[s] = self.expert_of[s], -1
            if self.slot_of.get(old) == s:
                del self.slot_of[old]
        reads = list(zip(missed, victims))
        at = dict(reads)
        return [self.slot_of.get(e, at.get(e)) for e in experts], reads

    def _evicted_before(self, slot: int) -> tuple[bool, int, int, int]:
        expert = self.expert_of[slot]
        return expert >= 0, self.uses[expert] if self.by_uses and expert >= 0 else 0, self.last_use[slot], slot

    def filled(self, reads: list[tuple[int, int]], slots: list[int]) -> None:
        """The ``reads`` are in: their slots hold their experts; ``slots`` (the call's) stamped as used now."""
        for e, s in reads:
            self.expert_of[s] = e
            self.slot_of[e] = s
        for s in slots:
            self.last_use[s] = self.clock


class ExpertReader:
    """Reads byte ranges of a ``.ptd`` into host buffers: chunks on a few threads, ``O_DIRECT``
    where the range and its target are aligned to the file's blocks and the file takes it."""

    def __init__(self, ptd: PtdFile, threads: int = READER_THREADS, direct: bool = True):
        self.path, self._identity = ptd.path, ptd.identity
        # both opened through the mapping's own descriptor: the file mapped, even if the path was replaced since
        self.mode, self._fd = open_for_reads(ptd.fileno(), direct)
        self._buffered_fd = -1
        try:
            self._buffered_fd = os.open(f"/proc/self/fd/{ptd.fileno()}", os.O_RDONLY) if self.mode == "O_DIRECT" else self._fd
        except BaseException:
            self._close_fds()
            raise
        self._executor = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="hostswap-experts")
        self.bytes_read = 0
        self.seconds = 0.0  # the callers' time spent waiting for reads
        self.direct_bytes = 0  # of bytes_read, read with O_DIRECT

    def read(self, requests) -> None:
        """Fill each ``(what, file offset, nbytes, buffer, start)``: ``nbytes`` of the file at
        the offset into ``buffer`` (a writable, page-aligned mmap) at ``start``; returns once
        all are read. Where ``start`` and the offset share their place within a disk block, the
        whole blocks between are read with ``O_DIRECT`` (where the file takes it)."""
        t = time.perf_counter()
        futures = []
        for what, offset, nbytes, buffer, start in requests:
            pieces = [(offset, nbytes, True)]
            if self.mode == "O_DIRECT" and (start - offset) % DIRECT_ALIGNMENT == 0:
                first = -(-offset // DIRECT_ALIGNMENT) * DIRECT_ALIGNMENT
                last = max(first, (offset + nbytes) // DIRECT_ALIGNMENT * DIRECT_ALIGNMENT)
                pieces = [(offset, min(first, offset + nbytes) - offset, True), (first, last - first, False), (last, offset + nbytes - last, True)]
            for at, length, buffered in pieces:
                if length <= 0:
                    continue
                for done in range(0, length, CHUNK_BYTES):
                    futures.append(self._executor.submit(self._read_chunk, self._buffered_fd if buffered else self._fd, what, at + done, buffer,
                                                         start + at - offset + done, min(CHUNK_BYTES, length - done), buffered))
                self.direct_bytes += 0 if buffered else length
        try:
            for f in futures:
                f.result()
        except BaseException:
            for f in futures:
                f.cancel()
            concurrent.futures.wait(futures)
            raise
        if file_identity(os.fstat(self._buffered_fd)) != self._identity:
            raise ArtifactError(self.path, "file", "changed on disk while routed experts were read from it; the weights it serves are no longer the ones checked at load. Load it again")
        self.bytes_read += sum(r[2] for r in requests)
        self.seconds += time.perf_counter() - t

    def _read_chunk(self, fd: int, what: str, offset: int, buffer, start: int, length: int, buffered: bool) -> None:
        with memoryview(buffer) as view, view[start : start + length] as target:
            try:
                got = pread_into(fd, target, offset)
            except OSError as e:  # O_DIRECT past a file cut to an unaligned length: EINVAL
                raise ArtifactError(self.path, what, f"cannot be read at offset {offset} ({e.strerror}): the file changed since load. Load it again") from None
        if got < length:
            raise ArtifactError(self.path, what, f"read {got} of {length} bytes at offset {offset}: the file is shorter than at load. Load it again")
        if buffered:  # whole pages: the partial ones at the ends would otherwise stay
            first = offset // mmap.PAGESIZE * mmap.PAGESIZE
            os.posix_fadvise(fd, first, -(-(offset + length) // mmap.PAGESIZE) * mmap.PAGESIZE - first, os.POSIX_FADV_DONTNEED)

    def _close_fds(self) -> None:
        for fd in {self._fd, self._buffered_fd} - {-1}:
            os.close(fd)
        self._fd = self._buffered_fd = -1

    def close(self) -> None:
        self._executor.shutdown(wait=True)
        self._close_fds()


class HostExpertCache:
    """``slots`` experts of one MoE block in pinned host memory, each brought from the ``.ptd``
    when a call picks it and the slots lack it, evicted as ``policy`` says (``HostSlots``)."""

    def __init__(self, block: ExpertBlock, ptd: PtdFile, slots: int, reader: ExpertReader, device: torch.device, policy: str = DEFAULT_POLICY):
        if not min(block.top_k, block.num_experts) <= slots <= block.num_experts:
            raise ValueError(f"a host cache of {block.block} needs top_k ({block.top_k}) to {block.num_experts} slots, not {slots}")
        self._slots = HostSlots(slots, block.num_experts, policy)
        self.block, self.slots, self.num_experts = block.block, slots, block.num_experts
        self.unit_bytes = block.unit_bytes
        self._reader, self._device = reader, device
        self._rows: list[tuple[str, int, int]] = []  # per table: (fqn, file offset of row 0, row bytes)
        self._buffers: list[tuple[mmap.mmap, int]] = []  # per table: (buffer, where slot 0 starts in it)
        self.host_tables: list[torch.Tensor] = []
        self._registered: list[int] = []
        self._of_source: dict[int, int] = {}  # data pointer of a table as the program binds it -> its place here
        try:
            for at, fqn in enumerate(block.tables):
                entry = ptd.entries[fqn]
                row_bytes = entry.nbytes // block.num_experts
                # anonymous pages are page-aligned; slot 0 starts where the rows start within a
                # disk block, so a row of whole blocks lands where its O_DIRECT middle is aligned
                lead = entry.offset % DIRECT_ALIGNMENT if row_bytes % DIRECT_ALIGNMENT == 0 else 0
                buffer = mmap.mmap(-1, max(lead + slots * row_bytes, mmap.PAGESIZE))
                self._buffers.append((buffer, lead))
                whole = torch.frombuffer(buffer, dtype=torch.uint8)
                table = whole[lead : lead + slots * row_bytes].view(entry.dtype).view(slots, *entry.shape[1:])
                if device.type == "cuda":
                    register_host_memory(whole.data_ptr(), len(buffer), what=f"the host expert slots of {fqn}")
                    self._registered.append(whole.data_ptr())
                self.host_tables.append(table)
                self._rows.append((fqn, entry.offset, row_bytes))
                self._of_source[ptd.host_tensor(fqn).data_ptr()] = at
            # what the kernels read: device views of the slots on CUDA, the slots themselves elsewhere
            self.tables = [device_view_of(t, device, f"the host expert slots of {fqn}") if device.type == "cuda" else t
                           for t, (fqn, _, _) in zip(self.host_tables, self._rows)]
        except BaseException:
            self.close()
            raise
        self._readers: list = [None] * slots  # per slot: the event after the last kernels that read it
        self.hits = self.misses = 0

    def tables_for(self, *sources: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        """The slots' tables standing for ``sources`` (the block's tables as its call got them)."""
        out = []
        for t in sources:
            if t is None:
                out.append(None)
                continue
            at = self._of_source.get(t.data_ptr())
            if at is None:
                raise AssertionError(f"the routed experts of {self.block} got a table its host cache does not hold")
            out.append(self.tables[at])
        return tuple(out)

    @property
    def policy(self) -> str:
        return self._slots.policy

    @property
    def expert_of(self) -> list[int]:
        return self._slots.expert_of

    @property
    def slot_of(self) -> dict[int, int]:
        return self._slots.slot_of

    def holds(self, expert: int) -> bool:
        return expert in self._slots.slot_of

    def bring(self, experts: list[int]) -> list[int]:
        """The slot of each of ``experts`` (distinct), those the slots lack read from the file
        into the slots the policy evicts (``HostSlots``) that no other of them holds."""
        if len(experts) > self.slots:
            raise ValueError(f"{len(experts)} experts of {self.block} at once; its host cache holds {self.slots}")
        slots, reads = self._slots.place(experts)
        requests = []
        for e, s in reads:  # each slot taken is empty until its read is in: an interrupted wait or read leaves it so
            if self._readers[s] is not None:  # the kernels that read its last expert are done first
                self._readers[s].synchronize()
                self._readers[s] = None
            for (fqn, offset, row_bytes), (buffer, lead) in zip(self._rows, self._buffers):
                requests.append((f"expert {e} of weight '{fqn}'", offset + e * row_bytes, row_bytes, buffer, lead + s * row_bytes))
        self._reader.read(requests)
        self._slots.filled(reads, slots)
        self.hits += len(experts) - len(reads)
        self.misses += len(reads)
        return slots

    def read_by_kernels(self, slots: list[int]) -> None:
        """The kernels queued so far read ``slots``: none of them is refilled before they finish."""
        if self._device.type != "cuda":
            return  # CPU kernels have run by now
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self._device))
        for s in slots:
            self._readers[s] = event

    def stats(self) -> dict:
        return {"slots": self.slots, "policy": self.policy, "hits": self.hits, "misses": self.misses,
                "bytes_read": self.misses * self.unit_bytes}

    def close(self) -> None:
        for pointer in self._registered:
            unregister_host_memory(pointer)
        self._registered = []
        self.tables = []
        self.host_tables = []
        # not closed here: a tensor over a buffer holds it, and the pages go with the last one
        self._buffers = []


def open_host_experts(plan: HostExpertPlan, blocks: tuple[ExpertBlock, ...], ptd: PtdFile, device: torch.device,
                      policy: str = DEFAULT_POLICY) -> tuple[ExpertReader | None, dict[str, HostExpertCache]]:
    """The reader and each block's host cache for a plan with experts on disk (none otherwise),
    evicting as ``policy`` says."""
    if not plan.on_disk:
        return None, {}
    reader = ExpertReader(ptd)
    caches: dict[str, HostExpertCache] = {}
    try:
        for b in blocks:
            caches[b.block] = HostExpertCache(b, ptd, plan.slots[b.block], reader, device, policy)
    except BaseException:
        close_host_experts(reader, caches)
        raise
    return reader, caches


def close_host_experts(reader: ExpertReader | None, caches: dict[str, HostExpertCache]) -> None:
    for cache in caches.values():
        cache.close()
    if reader is not None:
        reader.close()
