"""The ``planned`` weight pool: residency and ring offsets fixed at load, one arena.

``schedules.policies.plan_layout`` decides which weights stay resident and where in the ring
each streamed probe's copy goes, and which kernel each ring fill must wait for. This pool
allocates the arena once and issues the copies: a forward makes no allocator call, so it
can be captured in a CUDA graph.

When fills are issued:
- at a probe, every fill through the probe's issue horizon (prefetch depth, in streamed
  probes; a fill for the probe itself is a miss);
- with a prefetch depth of at least one, also as soon as the last kernel reading the ring
  bytes a fill overwrites has been launched;
- at the end of a forward, the next forward's first fills that its idle copy engine tail
  can hide (carried fills, measured on CUDA).

A fill of a weight in the disk tier (schedules/tiers.py) copies from the staging ring, where
the disk reader (runtime/disk_reader.py) has read it ahead in the same fill order; the region
goes back to the reader behind the copy's event.
"""

from __future__ import annotations

import torch

from hostswap.runtime.pool import PoolCreationError, ScheduleDivergenceError, WeightPool
from hostswap.schedules.policies import PlannedLayout, issue_horizon, plan_layout
from hostswap.schedules.weight_schedule import WeightSchedule


def carry_count(carry_bytes: list[int], span_s: float, tail_s: float, forward_bytes: int) -> int:
    """How many of the next forward's first fills (bytes ``carry_bytes``, in order) the idle
    tail of a forward hides: ``tail_s`` seconds of kernels after its last copy, at the rate its
    own copies achieved (``forward_bytes`` over ``span_s``)."""
    hidden = tail_s * forward_bytes / span_s
    count, total = 0, 0
    for nbytes in carry_bytes:
        total += nbytes
        if total > hidden:
            break
        count += 1
    return count


class PlannedPool(WeightPool):
    """Serves each probe from a fixed resident region or a fixed ring slot of one arena."""

    capturable = True

    def __init__(self, schedule: WeightSchedule, host_weights: dict[str, torch.Tensor], budget_bytes: int, device: torch.device, warm: bool = True,
                 layout: PlannedLayout | None = None, disk_reader=None, disk_fills: tuple[int, ...] = ()):
        # ``warm`` is accepted for the common signature: the arena is allocated and its resident
        # part copied here, so a planned pool is always warm at load. ``disk_fills``: the fill
        # probes ``disk_reader`` serves, in its read order.
        super().__init__(schedule, host_weights, budget_bytes, device)
        self.layout = layout = layout if layout is not None else plan_layout(schedule, budget_bytes)
        self.disk_reader = disk_reader
        self._disk_read_of = {q: i for i, q in enumerate(disk_fills)}  # fill probe -> its read in the reader's cycle
        try:
            self.arena = torch.empty(layout.arena_bytes, dtype=torch.uint8, device=device)
        except (RuntimeError, torch.OutOfMemoryError) as e:
            raise PoolCreationError(f"cannot allocate the {layout.arena_bytes}-byte weight arena on {device}: {e}") from e
        self._account(layout.arena_bytes)
        self._resident: dict[int, torch.Tensor] = {}
        for w, offset in layout.resident_offsets.items():
            t = self._typed(self.arena[offset : offset + self.sizes[w]], w)
            self.streams.copy(t, self.host[w])
            self._resident[w] = t
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        self._ring_tensor: dict[int, torch.Tensor] = {}  # probe -> tensor in the ring
        self._ring_ready: dict[int, object] = {}  # fill probe -> completion event of its copy
        for p, offset in {**layout.fill_offset, **layout.reuse_offset}.items():
            w = schedule.probe_weight[p]
            start = layout.ring_offset + offset
            self._ring_tensor[p] = self._typed(self.arena[start : start + self.sizes[w]], w)
        # reuse probe -> the fill probe whose copy it reads
        self._source_fill: dict[int, int] = {}
        last_fill: dict[tuple[int, int], int] = {}
        for p in range(schedule.num_probes):
            w = schedule.probe_weight[p]
            if p in layout.fill_offset:
                last_fill[(w, layout.fill_offset[p])] = p
            elif p in layout.reuse_offset:
                self._source_fill[p] = last_fill[(w, layout.reuse_offset[p])]
        self._fill_events = self.streams.completion_events(layout.fill_offset)
        # Only kernels that a ring fill waits for need an event (none when all is resident).
        waited = list(layout.fill_waits_for.values()) + list(layout.carry_waits_for.values())
        self._awaited_kernels = frozenset(k for k in waited if k >= 0)
        self._issue_through = issue_horizon(schedule, layout)
        self._issued = 0  # next probe whose fill (if it has one) is not yet issued this forward
        self._prefetched_fills: set[int] = set()
        self._forward_bytes = 0
        self._carry_order = sorted(layout.carry_waits_for)
        self._carry_count = 0
        self._carried: list[int] = []
        self._carry_frozen = False  # prepare_capture: fixed for a CUDA graph

    def streamed_weights(self) -> list[int]:
        return [w for w in range(len(self.host)) if w not in self.layout.resident_offsets]

    def close(self) -> None:
        super().close()
        if self.disk_reader is not None:
            self.disk_reader.close()
        self._resident.clear()
        self._ring_tensor.clear()
        self.arena = None

    @property
    def _fills_follow_releases(self) -> bool:
        # Depth 0, the no-prefetch reference, issues each copy at its own probe.
        return self.schedule.prefetch_depth >= 1

    # --- the interface ------------------------------------------------------------------------
    def begin_forward(self) -> None:
        self._decide_carry()  # from the last forward's timing, before its events are re-recorded
        super().begin_forward()
        self._issued = 0
        self._prefetched_fills = set()
        self._forward_bytes = 0
        carried, self._carried = self._carried, []
        if carried:  # copied at the end of the previous forward (end_forward)
            self._prefetched_fills.update(carried)
            self._issued = carried[-1] + 1
            if torch.cuda.is_current_stream_capturing():
                # A replay runs after the previous one has finished, carried copies included
                # (one graph launch after the other on the launching stream), and the first
                # after prepare_capture's synchronised copies: nothing to wait for inside the
                # graph, and an event recorded outside it cannot be waited on.
                for q in carried:
                    self._ring_ready[q] = None
        # Fills issued now, before the inputs are bound and the executor starts: the copy
        # engine starts earlier in a forward it bounds. Following releases: every leading fill
        # that overwrites nothing this forward reads, which includes all the first probe would
        # issue. Otherwise, on CUDA, those the first probe would issue (each overwrites nothing
        # this forward reads, or _issue_fill refuses).
        if self._fills_follow_releases:
            self._issue_released_fills()
        elif self.schedule.num_probes and self.streams.cuda:
            self._issue_fills_through(self._issue_through[0], None)

    def acquire(self, probe_id: int, fqn: str) -> torch.Tensor:
        self._check_probe(probe_id, fqn)
        w = self.schedule.probe_weight[probe_id]
        self._issue_fills_through(self._issue_through[probe_id], probe_id)
        if w in self._resident:
            self.stats.hits += 1
            return self._resident[w]
        if probe_id in self.layout.fill_offset:
            if probe_id in self._prefetched_fills:
                self._prefetched_fills.discard(probe_id)
                self.stats.prefetches_used += 1
            self.streams.compute_waits(self._ring_ready[probe_id])
        else:
            self.stats.hits += 1
            self.streams.compute_waits(self._ring_ready[self._source_fill[probe_id]])
        return self._ring_tensor[probe_id]

    def resident_tensor(self, probe_id: int, fqn: str) -> torch.Tensor:
        """The tensor probe ``probe_id`` reads, for a caller that binds it once (a compiled
        method): only a resident weight has one place for the pool's life."""
        w = self.schedule.probe_weight[probe_id]
        if self.schedule.fqns[w] != fqn or w not in self._resident:
            raise ValueError(f"probe {probe_id} ('{fqn}') does not read a resident weight of this pool")
        return self._resident[w]

    def kernel_launched(self, kernel: int) -> None:
        super().kernel_launched(kernel)
        if kernel in self._awaited_kernels:
            self.streams.kernel_launched(kernel)
            if self._fills_follow_releases:
                self._issue_released_fills()

    def end_forward(self) -> None:
        super().end_forward()
        if self._carry_count:
            self._carry_fills()

    def prepare_capture(self) -> None:
        """Fix the carry for a CUDA graph and place the fills its replays will take as carried.

        Call after at least one eager forward has finished (synchronised) and before capturing
        one. The carry count is decided once from that forward's measured tail and frozen: the
        captured forward skips the first ``_carry_count`` fills at its start and copies them at
        its end for the next replay, so the graph's idle tail copies as an eager forward's
        does. Here those fills are copied once, synchronously, for the first replay.
        """
        if not self.streams.cuda:
            super().prepare_capture()
        self._decide_carry()
        self._carry_frozen = True
        torch.cuda.synchronize(self.device)  # every reader of the ring has finished
        self._carried = []
        for q in self._carry_order[: self._carry_count]:
            self._copy_fill(q, -1)
            self._carried.append(q)
        torch.cuda.synchronize(self.device)

    def disable_carry(self) -> None:
        self._carry_count = 0
        self._carry_frozen = True

    # --- fills carried into the next forward --------------------------------------------------
    def _decide_carry(self) -> None:
        """How many of the next forward's first fills to issue at the end of each forward.

        When copies bound a forward, it ends with kernels that run after its last copy while
        the copy engine idles (in prefill, the last layer's MLP and the head behind the last
        streamed attention projection). The first fills of the next forward can copy in that
        idle tail. As many are carried as the measured tail hides at the bandwidth the
        forward's own copies achieved; none where the tail is short (decode): carrying there
        would only move copies from one forward to the other and leave the copy engine waiting
        at the next forward's head for the host to reach a probe that may issue more.
        Measured, not modelled: the decision follows the workload.
        """
        if self._carry_frozen or not (self.streams.cuda and self._carry_order):
            return
        times = self.streams.last_forward_times()
        if times is None or self._forward_bytes <= 0 or times[0] <= 0:
            return  # keep the last decision
        weight_bytes = [self.schedule.weight_bytes[self.schedule.probe_weight[q]] for q in self._carry_order]
        self._carry_count = carry_count(weight_bytes, times[0], times[1], self._forward_bytes)

    def _carry_fills(self) -> None:
        capturing = torch.cuda.is_current_stream_capturing()
        if capturing and not self._carry_frozen:
            return  # a graph's carried fills must match what prepare_capture placed
        for q in self._carry_order[: self._carry_count]:
            self.stats.bytes_carried += self._copy_fill(q, self.layout.carry_waits_for[q])
            self.stats.fills_carried += 1
            self._carried.append(q)
        if capturing:
            # Join the copy stream back into the captured work: the graph ends when its carried
            # copies have, and the next replay (stream-ordered after it) finds them done.
            self.streams.compute_stream.wait_stream(self.streams.copy_stream)

    # --- fills --------------------------------------------------------------------------------
    def _issue_fill(self, q: int) -> None:
        waits_for = self.layout.fill_waits_for[q]
        if waits_for > self._launched:
            # The event of a kernel not launched in this forward still holds the previous
            # forward's record: waiting on it would let the copy overwrite live bytes.
            raise ScheduleDivergenceError(
                f"ring fill for probe {q} ('{self.schedule.fqns[self.schedule.probe_weight[q]]}') must wait for kernel {waits_for}, "
                f"but only kernels up to {self._launched} have been launched in this forward"
            )
        self._forward_bytes += self._copy_fill(q, waits_for)

    def _copy_fill(self, q: int, waits_for: int) -> int:
        """Copy probe ``q``'s weight into its ring slot after kernel ``waits_for``; its bytes."""
        self.streams.copy_waits_for_kernel(waits_for)
        w = self.schedule.probe_weight[q]
        read = self._disk_read_of.get(q)
        if read is None:
            self._ring_ready[q] = self.streams.copy(self._ring_tensor[q], self.host[w], self._fill_events.get(q))
        else:
            data, region = self.disk_reader.take(read)
            host = self.host[w]
            self._ring_ready[q] = self.streams.copy(self._ring_tensor[q], data.view(host.dtype).view(host.shape), self._fill_events.get(q))
            self.disk_reader.release(region, self._ring_ready[q])
        self.stats.bytes_h2d += self.schedule.weight_bytes[w]
        return self.schedule.weight_bytes[w]

    def _issue_fills_through(self, last: int, probe_id: int | None) -> None:
        """Issue every ring fill up to probe ``last``; one for ``probe_id`` itself is a miss."""
        while self._issued <= last:
            q = self._issued
            if q in self.layout.fill_offset:
                self._issue_fill(q)
                if q == probe_id:
                    self.stats.misses += 1
                else:
                    self.stats.prefetches_issued += 1
                    self._prefetched_fills.add(q)
            self._issued += 1

    def _issue_released_fills(self) -> None:
        """Issue, in order, every next ring fill whose bytes the kernels launched so far release.

        The depth horizon issues a fill only a fixed number of streamed probes ahead, so at the
        head of a forward, after the carried fills, the copy engine would wait for the host to
        reach the probe that issues the next one although its ring slot was released by a
        kernel launched long before. Issued here, the copy waits on the GPU for that kernel's
        event (as every fill does), so the copy stream runs as far ahead as the ring allows.
        Stream order is kept: fills are issued in probe order, and the first one not yet
        released stops the walk, as does a fill from the disk tier not yet read.
        """
        waits_for, n = self.layout.fill_waits_for, self.schedule.num_probes
        while self._issued < n:
            q = self._issued
            if q in waits_for:
                if waits_for[q] > self._launched:
                    return
                read = self._disk_read_of.get(q)
                if read is not None and not self.disk_reader.ready(read):
                    # not read yet: waiting here would hold back the launches of kernels whose
                    # weights are ready; the next launch, or the probe that needs it, comes back
                    return
                self._issue_fill(q)
                self.stats.prefetches_issued += 1
                self._prefetched_fills.add(q)
            self._issued += 1
