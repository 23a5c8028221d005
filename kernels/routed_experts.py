"""The kernel of ``hostswap::routed_experts`` (passes/routed_experts.py): an MoE block's experts,
reading only the experts its router picked.

A block's experts are stacked tables (``gate_up`` [E, 2I, H], ``down`` [E, H, I], optional
biases [E, ...]); expert ``e`` is row ``e`` of each. The kernel reads those rows and nothing
else, so the weight pass treats the tables as row gathers (``graph_facts``): they are never
copied to the device whole, and a kernel on the GPU reads the picked rows from the tables'
mapped host pages.

Four ways through, chosen by the call's tokens (and whether a CUDA graph is being captured):

- **pairs** (one token: a decode step): each of its top-k experts' products, read where the
  rows lie (kernels/routed_gemv.py, on CUDA) or gathered by index and multiplied batched
  (elsewhere: transformers' ``batched_mm`` experts implementation, op for op); from an expert
  cache's device slots where the runtime gives the block one (``using_caches``), its misses
  filled by the products that read them. The expert ids stay on the device: no host sync, so a
  graphed decode step can hold it.
- **grouped** (prefill chunks, batched decode steps run eagerly): each expert of the call's
  union is read once and applied to all its tokens. On CUDA one launch per projection does it
  (kernels/routed_grouped.py): the picks sorted by expert on the device, the experts a
  block's cache holds read from its slots, the reads counted on the device; no host sync but,
  for a block with a cache, one to learn the last row's distinct experts for its fill. Elsewhere
  the host learns the union (one sync) and applies each expert in turn, as transformers' eager
  experts loop does. A block with a cache then gets the last row's experts into it (``fill``),
  for the decode step that follows;
- **union** (several tokens while a CUDA graph is captured: a batched decode step, a verify
  pass of speculative decoding; on CUDA): each expert any token picked, read once where its
  rows lie and multiplied by the vectors of the tokens that picked it, the others not read
  (kernels/routed_union.py). No host sync: the union is learnt on the device, by the programs
  of each expert, and counted there (``ExpertReads.on_device``). A block with an expert cache
  runs its pairs from the cache's slots instead (where the products read in place), its
  tokens looked up in turn: a miss crosses the bus once per group of tokens looked up
  together however many of them pick it, and a hit not at all.
- **dense** (the same calls where products are not read in place: off CUDA, without
  Triton): every expert applied to every token, weighted by its routing weight (zero where
  not picked); each expert read once, with no host sync and no gathered copies.

A decode step also gives the cache of the next routed block (``next_block``) a guess at its
experts: ``next_logits``, that block's router applied to this layer's residual stream
(experts.py), whose best scored experts the cache lacks are prefetched once this block's
products are queued, while the next attention runs (runtime/expert_cache.py). The guess
never decides what is computed: the next block looks its own router's picks up, and only its
misses wait for the bus.

Where a block's tables stay on disk (runtime/expert_store.py: more experts than the host
memory holds), its call learns its picks on the host, has the block's host cache bring them
from the file into pinned slots, and runs the path its tokens take from those slots (``rows``
of the slots' tables in place of the experts' rows), through the device cache where the block
has one. The call is eager (a forward with weights on disk is not graphed).

A batched decode step names the rows it reads (``reading_rows``: the slots with a sequence
decoding); the picks of the others become none (-1, weight 0), which a product read in place
and a cache's lookup skip, and an eager call's union leaves out. Those rows' outputs are 0.

An expert id outside ``0..E-1`` stops the call with ``ExpertIndexError`` naming the block
(on the GPU without a host sync: a device-side assertion), never a read of other bytes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading

import torch
import torch.nn.functional as F

from hostswap.kernels.expert_ids import ids_in_range
from hostswap.kernels.routed_gemv import routed_gemv, supports as routed_gemv_supports
from hostswap.kernels.routed_grouped import routed_grouped, segments
from hostswap.kernels.routed_union import routed_union

# activation name -> function (the gate of a gated expert, or the whole activation of a plain one)
ACTIVATIONS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "sigmoid": torch.sigmoid,
}
# gpt-oss' gate: clamped, a sigmoid-weighted linear unit with slope ``alpha``, and ``up + 1``
CLAMPED_SWIGLU = "clamped_swiglu"


class ExpertIndexError(IndexError):
    """A router picked an expert the block does not have."""


@dataclasses.dataclass
class ExpertReads:
    """Experts one block read, counted by the kernel as it runs: by eager calls on the host; a
    replayed CUDA graph runs no Python, so the runtime adds what its capture counted per
    replay, and the union and grouped kernels count on the device (``on_device``)."""

    calls: int = 0
    experts: int = 0  # rows read, summed over calls (a pair path reads one per pair)
    bytes: int = 0
    # What a call of a batch with its live rows marked (``reading_rows``) reads per live row:
    # a replayed graph reads as many rows as that replay's batch has live, which only the
    # runtime knows; it adds them in with ``fold``.
    row_experts: int = 0
    row_bytes: int = 0
    # What calls that read the union of their picks on the device (``routed_union``,
    # ``routed_grouped``) read: only the device learns the union, so their kernels (a replayed
    # graph's too) add it to this device counter, and ``settle`` moves it into
    # ``experts``/``bytes`` when the host asks.
    on_device: torch.Tensor | None = dataclasses.field(default=None, compare=False)
    on_device_seen: int = 0  # of the counter, what ``settle`` has moved in
    unit_bytes: int = 0

    def fold(self, live_rows: int) -> None:
        """Add the reads per live row in, for a forward of ``live_rows`` live rows."""
        self.experts += self.row_experts * live_rows
        self.bytes += self.row_bytes * live_rows
        self.row_experts = self.row_bytes = 0

    def add(self, other: "ExpertReads", live_rows: int) -> None:
        """Add ``other`` (what one replay of a captured forward reads) in, for ``live_rows`` live rows."""
        self.calls += other.calls
        self.experts += other.experts + other.row_experts * live_rows
        self.bytes += other.bytes + other.row_bytes * live_rows

    def counter(self, device: torch.device, unit_bytes: int) -> torch.Tensor:
        """The device counter a union or grouped call adds its experts to, made outside a
        capture (a tensor made inside one would be a graph's, reset at each replay)."""
        if self.on_device is None:
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise AssertionError("a block's union read counter is made by a forward before the capture (the warm-up's)")
            self.on_device = torch.zeros((), dtype=torch.int64, device=device)
            self.unit_bytes = unit_bytes
        return self.on_device

    def settle(self) -> None:
        """Add what the device counted since the last settle into ``experts`` and ``bytes``: a
        host sync, for stats. The host never writes the counter, so a replay that adds to it
        while it is read is counted at the next settle."""
        if self.on_device is not None:
            now = int(self.on_device.item())
            self.experts += now - self.on_device_seen
            self.bytes += (now - self.on_device_seen) * self.unit_bytes
            self.on_device_seen = now


# the counts one replay of a captured forward adds (the device counter adds itself)
REPLAYED_COUNTS = ("calls", "experts", "bytes", "row_experts", "row_bytes")


# What the running Module gives its kernels: where to count reads, and its expert caches. Per
# thread: two Modules running at once in two threads (a server's workers) must not see each
# other's, and block names repeat between models.
_context = threading.local()


@contextlib.contextmanager
def _setting(name: str, value):
    outer = getattr(_context, name, None)
    setattr(_context, name, value)
    try:
        yield value
    finally:
        setattr(_context, name, outer)


def recording_reads(into: dict[str, ExpertReads]):
    """Count the experts each block reads while the body runs, into ``into`` (block -> reads)."""
    return _setting("recorder", into)


def using_caches(caches: dict):
    """While the body runs, a decode step of a block in ``caches`` (block -> an expert cache
    with ``lookup(ids, tables)`` and ``tables``: runtime/expert_cache.py) reads its experts
    from the cache's slots, which it fills from the tables on a miss."""
    return _setting("caches", caches)


def using_host_experts(caches: dict):
    """While the body runs, a call of a block in ``caches`` (block -> a host cache of experts
    read from the disk: ``bring(experts)`` -> slots, ``holds(expert)``, ``tables_for(*tables)``,
    ``read_by_kernels(slots)``; runtime/expert_store.py) reads its experts from the cache's
    slots, which it fills from the file."""
    return _setting("host_experts", caches)


def reading_rows(live: torch.Tensor | None):
    """While the body runs, a call of several tokens reads the experts of the rows ``live``
    marks (a bool device tensor, one per row of the batch) and gives the others a zero output: a batched
    decode step's empty slots, whose outputs nobody reads, would otherwise read experts over
    the bus and hold cache slots. ``None``: every row is read."""
    return _setting("live_rows", live)


def _live_rows(block: str, tokens: int) -> torch.Tensor | None:
    """The rows a call of ``tokens`` tokens reads (``reading_rows``), or None for all."""
    live = getattr(_context, "live_rows", None)
    if live is None or tokens == 1:
        return None
    if tokens % live.numel():
        raise ValueError(f"the live rows given for this forward are {live.numel()}; {block} is called with {tokens} tokens, not a whole number per row")
    # a row's tokens are consecutive (a block's hidden states flattened from [rows, tokens, hidden])
    return live if tokens == live.numel() else live.repeat_interleave(tokens // live.numel())


def _without_dead_rows(ids: torch.Tensor, weights: torch.Tensor, live: torch.Tensor | None):
    """The picks and weights of a call with the rows ``live`` clears marked as no pick (-1,
    which the products and the caches skip) and weighted 0."""
    if live is None:
        return ids, weights
    dead = ~live[:, None]
    return ids.masked_fill(dead, -1), weights.masked_fill(dead, 0)


def _zero_dead_rows(out: torch.Tensor, live: torch.Tensor | None) -> torch.Tensor:
    """``out`` with the rows ``live`` clears set to 0: whatever their products met (a slot
    never filled, a bias), they give nothing to their residual stream."""
    return out if live is None else out.masked_fill_(~live[:, None], 0)


def warming_a_graph():
    """While the body runs, calls take the paths a CUDA graph's capture will take: the
    forwards before a capture launch its kernels once outside it (compiling and loading a
    Triton kernel is no work to capture)."""
    return _setting("warming", True)


def _graph_paths(hidden: torch.Tensor) -> bool:
    """Whether a call of several tokens must take a path without host syncs: captured in a
    CUDA graph, or a warm-up forward before a capture (on any device: the paths are device ops)."""
    return bool(getattr(_context, "warming", False)) or (hidden.is_cuda and torch.cuda.is_current_stream_capturing())


def _record(block: str, experts: int, unit_bytes: int) -> None:
    recorder = getattr(_context, "recorder", None)
    if recorder is not None:
        reads = recorder.setdefault(block, ExpertReads())
        reads.calls += 1
        reads.experts += experts
        reads.bytes += experts * unit_bytes


def _record_pairs(block: str, ids: torch.Tensor, unit_bytes: int, live: torch.Tensor | None) -> None:
    """Count a pair path's reads: one expert per (token, pick), or per live row's (its tokens' picks)."""
    if live is None:
        _record(block, ids.numel(), unit_bytes)
        return
    _record(block, 0, unit_bytes)
    reads = getattr(_context, "recorder", None)
    if reads is not None:
        per_row = ids.numel() // _context.live_rows.numel()
        reads[block].row_experts += per_row
        reads[block].row_bytes += per_row * unit_bytes


def _device_counter(block: str, ids: torch.Tensor, unit_bytes: int) -> torch.Tensor | None:
    """Count a call whose kernel counts the experts it reads on the device (a union or grouped
    call), and return the device counter it adds them to (no host sync), or None where nothing
    records reads."""
    recorder = getattr(_context, "recorder", None)
    if recorder is None:
        return None
    _record(block, 0, unit_bytes)
    return recorder[block].counter(ids.device, unit_bytes)


def unit_bytes(*tables: torch.Tensor | None) -> int:
    """Bytes of one expert: one row of each table."""
    return sum(t[0].numel() * t.element_size() for t in tables if t is not None)


def gate(x: torch.Tensor, activation: str, gated: bool, interleaved: bool, alpha: float, limit: float) -> torch.Tensor:
    """The expert's activation: of gate times up (halves, or alternate columns where
    ``interleaved``) for a gated expert, of the whole projection for a plain one."""
    if not gated:
        return ACTIVATIONS[activation](x)
    gate, up = (x[..., ::2], x[..., 1::2]) if interleaved else x.chunk(2, dim=-1)
    if activation == CLAMPED_SWIGLU:
        gate = gate.clamp(min=None, max=limit)
        up = up.clamp(min=-limit, max=limit)
        return (up + 1) * (gate * torch.sigmoid(gate * alpha))
    return ACTIVATIONS[activation](gate) * up


def _check_ids(ids: torch.Tensor, num_experts: int, block: str) -> None:
    message = f"the router of {block} picked an expert outside 0..{num_experts - 1}; refusing to read another expert's weights"
    if ids.device.type == "cuda":
        # no host sync: a device-side assertion stops the stream (and the process's CUDA context)
        torch._assert_async(ids_in_range(ids, num_experts), message)
    elif not bool(ids_in_range(ids, num_experts)):
        bad = ids[(ids < 0) | (ids >= num_experts)][0].item()
        raise ExpertIndexError(f"{message} (expert {bad})")


def _reads_in_place(hidden, gate_up, down) -> bool:
    """Whether the pairs run as products read in place (kernels/routed_gemv.py): on CUDA with
    Triton. Elsewhere the picked rows are gathered and multiplied batched."""
    return routed_gemv_supports(hidden, gate_up) and routed_gemv_supports(hidden, down)


def _pairs(hidden, ids, weights, gate_up, down, gate_up_bias, down_bias, activate, transposed, fill=None, union=False, count_into=None,
           grouped=None, cached=None):
    """Each (token, expert) pair through its expert's rows: transformers'
    ``batched_mm_experts_forward`` arithmetic (its gathered batched matmul, or on CUDA the same
    products read in place). A pick of -1 is none (its weight is 0; read in place, none of its
    matrices' bytes are read). ``fill`` = ((gate_up source, down source), source rows, copy):
    ``gate_up`` and ``down`` are a cache's slots whose missed rows (``copy`` set) the products
    read from the sources and fill as they go (products read in place only). ``union``: the
    pairs' products read each picked expert once, over the tokens that picked it
    (kernels/routed_union.py; products read in place only), adding the experts read to the
    device counter ``count_into`` where one is given. ``grouped`` (the picks' ``segments``): the
    same, for an eager call of any number of tokens (kernels/routed_grouped.py), the experts an
    expert cache holds read from its slots (``cached`` = (slot_of, (gate_up slots, down slots),
    hits counter)) where given."""
    tokens, k = ids.shape
    flat = ids.reshape(-1)
    gemv = _reads_in_place(hidden, gate_up, down)
    if (fill is not None or union or grouped is not None) and not gemv:
        raise AssertionError("only products read in place fill a cache's missed rows or read the union of the picks")
    # one token's vector is shared by its picks where the products are read in place
    selected = hidden if gemv and (tokens == 1 or union or grouped is not None) else hidden.repeat_interleave(k, dim=0)
    gate_up_source, down_source = fill[0] if fill is not None else (None, None)

    # a row of -1 (no pick: weighted 0) gathers row 0 where the products do not skip it (none do on gathered rows)
    at = flat.clamp(min=0) if not gemv or gate_up_bias is not None or down_bias is not None else None

    def linear(x, table, bias, source):
        first = x is selected  # (union, grouped) the first product's vectors are the tokens' (and it counts the experts read), the second's the picks'
        if grouped is not None:
            slots = None if cached is None else (cached[0], cached[1][0 if first else 1], cached[2])
            out = routed_grouped(x, table, ids, grouped, transposed, per_pick=not first, count_into=count_into if first else None, cached=slots)
        elif union:
            out = routed_union(x, table, ids, transposed, per_pick=not first, count_into=count_into if first else None)
        elif gemv:
            out = routed_gemv(x, table, flat, transposed, None if source is None else (source, fill[1], fill[2]))
        else:
            w = table[at]
            out = torch.bmm(x.unsqueeze(1), w).squeeze(1) if transposed else torch.bmm(w, x.unsqueeze(-1)).squeeze(-1)
        if bias is not None:
            out.add_(bias[at])
        return out

    out = linear(activate(linear(selected, gate_up, gate_up_bias, gate_up_source)), down, down_bias, down_source)
    out = out * weights.reshape(-1).unsqueeze(-1)
    return out.view(tokens, k, -1).sum(dim=1).to(hidden.dtype)


def _expert(x, e: int, gate_up, down, gate_up_bias, down_bias, activate, transposed):
    """Expert ``e`` (row ``e`` of each table) over the rows of ``x``, as transformers' eager loop
    computes it."""
    def linear(x, table, bias):
        if transposed:
            y = x @ table[e]
            return y + bias[e] if bias is not None else y
        return F.linear(x, table[e], bias[e] if bias is not None else None)

    return linear(activate(linear(x, gate_up, gate_up_bias)), down, down_bias)


def _grouped(hidden, ids, weights, gate_up, down, gate_up_bias, down_bias, activate, transposed, num_experts: int, host=None, rows=None):
    """Each expert of the union once, over its tokens: transformers' eager experts loop, its
    sums in the order of the experts. With ``host`` (a host cache of experts read from the disk,
    whose slots the tables are) the union goes through the slots as many experts at a time as
    they hold, those the slots hold first: in the experts' order, a union larger than the slots
    would evict each expert just before the next call asks for it, and miss every one. With
    ``rows`` (``_live_indices``), the union and the products are those rows' alone; the others'
    outputs are 0."""
    if rows is not None:
        out = torch.zeros_like(hidden)
        if not rows.numel():
            return out, 0
        at = rows.to(hidden.device)
        part, read = _grouped(hidden[at], ids[at], weights[at], gate_up, down, gate_up_bias, down_bias, activate, transposed, num_experts, host)
        return out.index_copy_(0, at, part), read
    out = torch.zeros_like(hidden)
    experts = torch.unique(ids).tolist()  # the host learns the union: one sync per call
    mask = F.one_hot(ids, num_classes=num_experts).permute(2, 1, 0)
    order = experts if host is None else sorted(experts, key=lambda e: not host.holds(e))
    step = max(1, len(experts) if host is None else host.slots)
    products = {}
    for start in range(0, len(order), step):
        part = order[start : start + step]
        rows = part if host is None else host.bring(part)
        for e, row in zip(part, rows):
            slot, token = torch.where(mask[e])
            y = _expert(hidden[token], row, gate_up, down, gate_up_bias, down_bias, activate, transposed)
            products[e] = (token, y * weights[token, slot, None])
        if host is not None:
            host.read_by_kernels(rows)  # before the next part may refill a slot these products read
    for e in experts:
        token, y = products[e]
        out.index_add_(0, token, y.to(out.dtype))
    return out, len(experts)


def _dense(hidden, ids, weights, gate_up, down, gate_up_bias, down_bias, activate, transposed):
    """Every expert over every token, each token's output weighted by its routing weight (zero
    where the expert is not among its picks): each expert's rows read once, no host sync and
    no gathered copies. For a captured call of several tokens (a batched decode step) where
    products are not read in place (off CUDA, without Triton)."""
    num_experts = gate_up.shape[0]
    # [tokens, experts]: a token's weight for each expert, summed over its picks
    routing = torch.zeros(ids.shape[0], num_experts, dtype=weights.dtype, device=weights.device).scatter_add_(1, ids, weights)
    out = torch.zeros(hidden.shape, dtype=torch.float32 if hidden.dtype != torch.float64 else hidden.dtype, device=hidden.device)
    for e in range(num_experts):
        out += _expert(hidden, e, gate_up, down, gate_up_bias, down_bias, activate, transposed) * routing[:, e : e + 1]
    return out.to(hidden.dtype)


def _cached_pairs(hidden, ids, weights, tables, cache, activate, transposed, live=None):
    """A captured call of several tokens (a batched decode step) through the block's expert
    cache: each token looks its top-k up in turn, its misses copied into slots (a later token
    that picks the same expert then hits it), and each (token, expert) pair is multiplied from
    its slot. As many tokens at a time as the slots hold every pick of: a token's lookup holds
    the slots the tokens before it in the group stamped (``recent``), whatever the policy, so a
    group's slots all hold its picks when its products read them; the next group's
    lookups come after those products on the stream. A row ``live`` clears looks nothing up
    (its slots are -1: no pick) and reads nothing."""
    tokens, k = ids.shape
    group = max(1, cache.slots // k)
    out = []
    for start in range(0, tokens, group):
        end = min(tokens, start + group)
        rows = torch.cat([cache.lookup(ids[t], tables, live=None if live is None else live[t], recent=t - start)[0]
                          for t in range(start, end)]).view(end - start, k)
        out.append(_pairs(hidden[start:end], rows, weights[start:end], *cache.tables, activate, transposed))
    return torch.cat(out) if len(out) > 1 else out[0]


def _prefetch_next(caches, next_block: str, next_logits: torch.Tensor | None) -> None:
    """Queue the next routed block's guessed experts into its cache (when it has one)."""
    cache = caches.get(next_block) if caches and next_block and next_logits is not None else None
    if cache is not None and cache.prefetching:
        cache.prefetch(cache.guess(next_logits))


def _through_device_cache(cache, experts: list[int], host, device) -> tuple[list[int], torch.Tensor]:
    """``experts`` (distinct) about to be looked up or filled in the device ``cache``: those it
    lacks brought into ``host``'s slots (one held on the device is read from there, so its bytes
    need not come from the disk), and the host slot row of each (0, never read, for those held).
    Returns (the host slots brought, the rows)."""
    held = (cache.slot_of[torch.tensor(experts, device=device)] >= 0).tolist() if cache is not None else [False] * len(experts)
    lacking = [e for e, h in zip(experts, held) if not h]
    slots = host.bring(lacking)
    row_of = dict(zip(lacking, slots))
    return slots, torch.tensor([row_of.get(e, 0) for e in experts], device=device)


def _live_indices(live: torch.Tensor | None) -> torch.Tensor | None:
    """The live rows of an eager call, learnt on the host once (a host sync: for the eager loop,
    which learns the union there anyway, or a cache's fill of the last live row), or None for all."""
    return None if live is None else live.cpu().nonzero().squeeze(1)


def _last_row(ids: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor | None:
    """The last row's picks of a call of several tokens (of its ``rows``, the last), or None."""
    if rows is None:
        return ids[-1]
    return ids[int(rows[-1])] if rows.numel() else None


def _from_host(hidden, ids, weights, tables, host, cache, activate, transposed, block: str, num_experts: int, live=None):
    """A call of a block whose tables are on disk: its picks learnt on the host and brought into
    ``host``'s slots, then the pairs (one token) or the union (several; its ``live`` rows') read
    from those slots, through the device ``cache`` where the block has one (whose hits need
    nothing from the disk)."""
    picks = ids.cpu()  # experts on disk are read by the host: one sync per block and call
    _check_ids(picks, num_experts, block)
    slots_tables = host.tables_for(*tables)
    if ids.shape[0] > 1:
        live_rows = _live_indices(live)
        out, read = _grouped(hidden, ids, weights, *slots_tables, activate, transposed, num_experts, host=host, rows=live_rows)
        _record(block, read, unit_bytes(*tables))
        last = _last_row(picks, live_rows) if cache is not None else None
        if last is not None:  # the decode after a prefill chunk starts with its last row's experts cached
            last = torch.unique(last).tolist()
            slots, rows = _through_device_cache(cache, last, host, ids.device)
            cache.fill(torch.tensor(last, device=ids.device), slots_tables, rows=rows)
            host.read_by_kernels(slots)
        return out
    _record(block, ids.numel(), unit_bytes(*tables))
    flat = picks.reshape(-1).tolist()  # one token's top-k: distinct
    slots, rows = _through_device_cache(cache, flat, host, ids.device)
    read, fill, at = slots_tables, None, rows.view_as(ids)
    if cache is not None:  # the picks' device slots, the missed ones filled from the host slots
        in_pass = (0, 1) if _reads_in_place(hidden, *slots_tables[:2]) else ()
        device_slots, missed = cache.lookup(ids, slots_tables, left=in_pass, rows=rows)
        at, read = device_slots.view_as(ids), cache.tables
        fill = (slots_tables[:2], rows, missed) if in_pass else None
    out = _pairs(hidden, at, weights, *read, activate, transposed, fill)
    host.read_by_kernels(slots)
    return out


def routed_experts(hidden, top_k_index, top_k_weights, gate_up, down, gate_up_bias, down_bias, activation, gated, interleaved, transposed, alpha, limit, block,
                   next_logits=None, next_block=""):
    num_experts = gate_up.shape[0]
    gate_of = lambda x: gate(x, activation, gated, interleaved, alpha, limit)  # noqa: E731
    tables = (gate_up, down, gate_up_bias, down_bias)
    caches = getattr(_context, "caches", None)
    cache = caches.get(block) if caches else None
    hosts = getattr(_context, "host_experts", None)
    host = hosts.get(block) if hosts else None
    live = _live_rows(block, top_k_index.shape[0])  # None unless a batch marks the rows it reads
    if host is not None:
        if cache is not None:
            cache.settle()
        return _from_host(hidden, top_k_index, top_k_weights, tables, host, cache, gate_of, transposed, block, num_experts, live)
    _check_ids(top_k_index, num_experts, block)
    if top_k_index.shape[0] == 1:  # one token: its top-k (gathered off CUDA: k experts of scratch)
        _record(block, top_k_index.numel(), unit_bytes(*tables))
        rows, read, fill = top_k_index, tables, None
        if cache is not None:  # the picks' slots; the missed ones filled first, or by the products that read them
            in_pass = (0, 1) if _reads_in_place(hidden, gate_up, down) else ()
            slots, missed = cache.lookup(top_k_index, tables, left=in_pass)
            rows, read = slots.view_as(top_k_index), cache.tables
            fill = ((gate_up, down), top_k_index.reshape(-1), missed) if in_pass else None
        out = _pairs(hidden, rows, top_k_weights, *read, gate_of, transposed, fill)
        # after this block's products, whose misses use the bus: the guess takes it while the next attention runs
        _prefetch_next(caches, next_block, next_logits)
        return out
    if cache is not None:
        cache.settle()  # no prefetch is left unjoined (a CUDA graph's capture must end on one stream)
    if _graph_paths(hidden):  # a graph cannot learn the union on the host
        if cache is not None and (_reads_in_place(hidden, gate_up, down) or not hidden.is_cuda):
            # (a gathered copy of a group's picks on CUDA would be memory the floor does not hold)
            _record_pairs(block, top_k_index, unit_bytes(*tables), live)
            out = _cached_pairs(hidden, *_without_dead_rows(top_k_index, top_k_weights, live), tables, cache, gate_of, transposed, live)
            return _zero_dead_rows(out, live)
        if _reads_in_place(hidden, gate_up, down):  # each expert a live row picked, once
            ids, weights = _without_dead_rows(top_k_index, top_k_weights, live)
            counter = _device_counter(block, ids, unit_bytes(*tables))
            return _zero_dead_rows(_pairs(hidden, ids, weights, *tables, gate_of, transposed, union=True, count_into=counter), live)
        _record(block, num_experts, unit_bytes(*tables))  # every expert, once, whatever the rows
        return _zero_dead_rows(_dense(hidden, top_k_index, top_k_weights, *tables, gate_of, transposed), live)
    if _reads_in_place(hidden, gate_up, down):  # each expert the live rows picked, once, in one launch per projection, learnt on the device
        ids, weights = _without_dead_rows(top_k_index, top_k_weights, live)
        counter = _device_counter(block, ids, unit_bytes(*tables))
        held = cache.held_like(tables) if cache is not None else None  # what the cache holds is read from its slots
        out = _zero_dead_rows(_pairs(hidden, ids, weights, *tables, gate_of, transposed, count_into=counter, grouped=segments(ids, num_experts),
                                     cached=held), live)
        live_rows = _live_indices(live) if cache is not None else None
    else:
        live_rows = _live_indices(live)
        out, read = _grouped(hidden, top_k_index, top_k_weights, *tables, gate_of, transposed, num_experts, rows=live_rows)
        _record(block, read, unit_bytes(*tables))
    last = _last_row(top_k_index, live_rows) if cache is not None else None
    if last is not None:  # the decode after a prefill chunk starts with its last row's experts cached
        # (a padded last chunk's padding repeats the prompt's last token: a near guess of its experts)
        cache.fill(torch.unique(last), tables)
    return out
