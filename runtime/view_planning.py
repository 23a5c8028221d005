"""Planning the views of a loaded method: which copies run as views, and where activations live.

The edge dialect turns every view into a copy into its own planned buffer, and ExecuTorch
plans memory for that copy-everything program; eager PyTorch runs views as views. Here each
view-like copy whose result would be bitwise the same as a view is made a view, and the
activation memory is planned again so that as many may be as possible (``replan_with_views``);
where re-planning does not apply, copies are made views inside ExecuTorch's own plan
(``elide_copies``). ``plan_views`` applies the first that serves.
"""

from __future__ import annotations

import bisect

import torch

from hostswap.runtime.instructions import Kernel, copy_into
from hostswap.runtime.method_loader import LoadedMethod, tensor_from_arena
from hostswap.schedules.op_facts import view_for_copy


# Views a copy may become, by name: (keeps a contiguous input contiguous, needs a contiguous
# input). ``view`` needs one to be a view at all; the others make strided views of any input.
VIEW_CONTIGUITY = {
    "view": (True, True),
    "unsqueeze": (True, False),
    "squeeze": (True, False),
    "alias": (True, False),
    "permute": (False, False),
    "transpose": (False, False),
    "t": (False, False),
    "expand": (False, False),
    "slice": (False, False),
    "select": (False, False),
}


PLACEMENT_BLOCK = 64  # instructions per stretch of the arena placement's index


def _identity(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _regions_overlap(a: tuple[int, int, int] | None, b: tuple[int, int, int] | None) -> bool:
    """Two (memory id, start, end) arena regions share a byte."""
    return a is not None and b is not None and a[0] == b[0] and a[1] < b[2] and b[1] < a[2]


def plan_views(m: LoadedMethod) -> int:
    """Run ``m``'s view-like copies as views where that changes no bit; the number made views."""
    replanned = replan_with_views(m)
    return elide_copies(m) if replanned is None else replanned


def replan_with_views(m: LoadedMethod) -> int | None:
    """Run view-like copies as views, and plan the activation memory so that they may.

    ExecuTorch plans memory for its copy-everything edge dialect: a copy's source buffer
    is reused as soon as the copy has read it, so few copies can later run as views
    (``elide_copies``). Here the copies are turned into views first, every view extends
    the life of the buffer it reads, and the buffers are placed again (largest first,
    lowest offset free over its lifetime) in one arena. Returns the number of copies run
    as views, or None to keep ExecuTorch's plan (jumps or moves, or a planned value whose
    aliasing is not understood).
    """
    if any(ins.tag in ("jump_false", "move") for ins in m.instructions):
        return None
    n = len(m.instructions)
    inputs, outputs = set(m.plan.inputs), set(m.plan.outputs)
    write_pcs: dict[int, list[int]] = {}
    read_pcs: dict[int, list[int]] = {}
    for pc in range(n):
        for v in m.writes[pc]:
            write_pcs.setdefault(v, []).append(pc)
        for v in m.reads[pc]:
            read_pcs.setdefault(v, []).append(pc)
    # program state keeps its place: it outlives the call
    planned = [v for v in m.regions if v in m.meta and m.regions[v][0] not in m.state_ids]
    is_planned = set(planned)
    # Values no instruction writes are views ExecuTorch folded into planning: find the
    # written value whose bytes they read (the last one written into them before).
    # Searched backwards from the first read over the writes in program order: the base is
    # written shortly before its view is read, and a scan of every value per view grows with
    # the square of the program.
    writes = sorted((p, u) for u in planned for p in write_pcs.get(u, ()))
    write_order = [p for p, _ in writes]
    folded_base: dict[int, int] = {}
    for v in planned:
        if write_pcs.get(v) or v in inputs:
            continue
        mem, lo, hi = m.regions[v]
        first = min(read_pcs.get(v, [n]))
        found = None  # (pc, value) of the latest write before ``first`` into bytes that hold v's
        for i in range(bisect.bisect_left(write_order, first) - 1, -1, -1):
            p, u = writes[i]
            if found is not None and p < found[0]:
                break
            if u != v and m.regions[u][0] == mem and m.regions[u][1] <= lo and hi <= m.regions[u][2]:
                found = max(found, (p, u)) if found is not None else (p, u)
        if found is None:
            if hi > lo:
                return None
            continue
        folded_base[v] = found[1]
    folded_of = set(folded_base.values())
    # Decide the views. root: the buffer a view reads; contiguous: whether the view is.
    root: dict[int, int] = {}
    contiguous = dict(m.contiguous)
    views: dict[int, object] = {}  # pc -> the view op its copy runs as
    # program state (a KV cache) may be viewed too (a layer's cache unsqueezed and expanded for
    # its attention) while no instruction writes its bytes until the views' last read
    state = {v for v in m.regions if v in m.meta and m.regions[v][0] in m.state_ids}
    for pc, x, y, view_op, keeps_contiguity, needs_contiguous in _copies_viewable(m):
        if (x not in is_planned and x not in state) or y not in is_planned or y in inputs or write_pcs.get(y) != [pc] or y in folded_of:
            continue
        if needs_contiguous and not contiguous.get(x, False):
            continue
        # the buffer x's bytes live in: a view ExecuTorch folded into planning (the reshape
        # between a projection and its transpose) reads its base's bytes
        r = root.get(x, x)
        r = folded_base.get(r, r)
        if r not in state and any(p > pc for p in write_pcs.get(r, [])):
            continue  # the buffer is written again later: a view would see the new bytes
        root[y] = r
        contiguous[y] = keeps_contiguity and contiguous.get(x, False)
        views[pc] = view_op
    _drop_views_of_rewritten_state(m, state, root, views, read_pcs, outputs, n)
    # Lifetimes of the buffers that remain: first write (inputs: the start) to the last read
    # of the buffer, of the views ExecuTorch folded into it and of the views made here.
    owner = {v: root.get(v, v) for v in planned}
    owner.update({v: owner[b] for v, b in folded_base.items()})
    life: dict[int, list[int]] = {}
    for v in planned:
        o = owner[v]
        if o in folded_base or o in root or o in state:
            continue
        span = life.setdefault(o, [n, -1])
        pcs = write_pcs.get(v, []) + read_pcs.get(v, [])
        if v in inputs:
            pcs = pcs + [0]
        if v in outputs:
            pcs = pcs + [n]
        if pcs:
            span[0], span[1] = min(span[0], min(pcs)), max(span[1], max(pcs))
    sizes = {o: m.regions[o][2] - m.regions[o][1] for o in life}
    placed: list[tuple[int, int, int, int]] = []  # offset, end, first, last
    # placed buffers by the stretches of PLACEMENT_BLOCK instructions their lives touch: the
    # ones a buffer may collide with are found among its own stretches' (most buffers live a
    # few instructions), not among every buffer placed so far
    placed_in_block: dict[int, list[int]] = {}
    offset_of: dict[int, int] = {}
    align = 256
    for o in sorted(life, key=lambda o: (-sizes[o], o)):
        first, last = life[o]
        if sizes[o] == 0:
            offset_of[o] = 0
            continue
        blocks = range(first // PLACEMENT_BLOCK, last // PLACEMENT_BLOCK + 1)
        near = {i for block in blocks for i in placed_in_block.get(block, ())}
        busy = sorted((placed[i][0], placed[i][1]) for i in near if not (placed[i][3] < first or last < placed[i][2]))
        offset = 0
        for a, b in busy:
            if offset + sizes[o] <= a:
                break
            offset = max(offset, -(-b // align) * align)
        offset_of[o] = offset
        for block in blocks:
            placed_in_block.setdefault(block, []).append(len(placed))
        placed.append((offset, offset + sizes[o], first, last))
    total = max((b for _, b, _, _ in placed), default=0)
    arena = torch.empty(total, dtype=torch.uint8, device=m.device)
    m.arenas = {**{i: a for i, a in m.arenas.items() if i in m.state_ids}, 0: arena}
    m.arena_bytes = total
    new_regions = {}
    for v in planned:
        if v in root:
            m.values[v] = None  # bound by its view instruction on every run
            continue
        # a folded view sits where it sat in its base (its base is never a view made here)
        start = offset_of[owner[v]] + (m.regions[v][1] - m.regions[folded_base[v]][1] if v in folded_base else 0)
        m.values[v] = tensor_from_arena(m.meta[v], m.arenas, at=(0, start))
        new_regions[v] = (0, start, start + m.regions[v][2] - m.regions[v][1])
    for v in root:
        new_regions[v] = m.regions[root[v]] if root[v] in state else new_regions[root[v]]
    for v in state:
        new_regions[v] = m.regions[v]
    m.regions = new_regions
    for pc, view_op in views.items():
        _run_as_view(m, pc, view_op)
    return len(views)


def _drop_views_of_rewritten_state(m: LoadedMethod, state: set[int], root: dict, views: dict, read_pcs: dict, outputs: set, n: int) -> None:
    """Keep as copies the views of a state value whose bytes an instruction writes between
    the view and the last read of anything viewing them (program outputs count as read at
    the end): such a view would read the new bytes."""
    by_root: dict[int, list[int]] = {}
    for v, r in root.items():
        if r in state:
            by_root.setdefault(r, []).append(v)
    pc_of = {m.instructions[pc].keyword.get("out"): pc for pc in views}  # a view's value -> the copy it replaces
    for r, viewing in by_root.items():
        made = {pc_of[v] for v in viewing}
        first = min(made)
        last = max(max(read_pcs.get(v, [first])) if v not in outputs else n for v in viewing)
        region = m.regions[r]
        if any(_regions_overlap(region, m.regions.get(w)) for p in range(first + 1, min(last, n - 1) + 1) for w in m.writes[p]):
            for v in viewing:
                del root[v]
            for pc in made:
                del views[pc]


def elide_copies(m: LoadedMethod) -> int:
    """Run ``*_copy`` view ops (and same-dtype contiguous casts) between planned tensors as views.

    The edge dialect turns every view into a copy into its own planned buffer; eager
    PyTorch runs them as views. A copy ``Y = f_copy(X)`` may become ``Y = f(X)`` when the
    buffer that ``X`` lives in (its alias root) is written by no instruction from here to
    the last read of ``Y`` or of anything aliased to the same root (program outputs count
    as read at the end), and no view folded into memory planning reads ``Y``'s own bytes.
    Programs with jumps or moves keep every copy.
    """
    if any(ins.tag in ("jump_false", "move") for ins in m.instructions):
        return 0
    n = len(m.instructions)
    last_read: dict[int, int] = {}
    for pc, reads in enumerate(m.reads):
        for v in reads:
            last_read[v] = pc
    for v in m.plan.outputs:
        last_read[v] = n
    write_count: dict[int, int] = {}
    for writes in m.writes:
        for v in writes:
            write_count[v] = write_count.get(v, 0) + 1
    inputs = set(m.plan.inputs)
    # A planned value that no instruction writes is a view ExecuTorch folded into memory
    # planning (it shares the bytes of the tensor it views). A copy whose output bytes are
    # read that way must keep writing them.
    folded_views = [m.regions[v] for v in m.regions if write_count.get(v, 0) == 0 and v not in inputs]
    root: dict[int, int] = {}
    group_end: dict[int, int] = {}
    contiguous = dict(m.contiguous)

    elided = 0
    for pc, x, y, view_op, keeps_contiguity, needs_contiguous in _copies_viewable(m):
        if x not in m.regions or y not in m.regions or y in inputs or write_count.get(y, 0) != 1 or m.regions[y][0] in m.state_ids:
            continue
        if needs_contiguous and not contiguous.get(x, False):
            continue
        if any(_regions_overlap(m.regions[y], f) for f in folded_views):
            continue
        r = root.get(x, x)
        end = max(group_end.get(r, pc), last_read.get(y, pc))
        if any(_regions_overlap(m.regions[r], m.regions.get(w)) for p in range(pc + 1, min(end, n - 1) + 1) for w in m.writes[p]):
            continue
        root[y], group_end[r] = r, end
        contiguous[y] = keeps_contiguity and contiguous.get(x, False)
        m.regions[y] = m.regions[r]
        _run_as_view(m, pc, view_op)
        elided += 1
    return elided


def _view_of_copy(m: LoadedMethod, ins):
    op = ins.op
    if op is copy_into or op._schema.name in ("aten::_to_copy", "aten::clone"):  # casts and clones
        # a cast to the dtype it already has, of a contiguous tensor, is the tensor itself
        x, out = ins.positional[0], ins.keyword.get("out")
        if ins.constant_keyword.get("memory_format") in (None, torch.contiguous_format, torch.preserve_format) and out is not None and x in m.regions and m.values[x].dtype == m.values[out].dtype:
            return (_identity, True, True)
        return None
    view_op = view_for_copy(op)
    contiguity = VIEW_CONTIGUITY.get(view_op._schema.name.split("::")[1]) if view_op is not None else None
    if contiguity is not None:
        return (view_op, *contiguity)
    return None


def _copies_viewable(m: LoadedMethod):
    """(pc, source, output, view op, keeps contiguity, needs a contiguous source) of every
    copy kernel that could run as a view; the callers decide which may."""
    for pc, ins in enumerate(m.instructions):
        if ins.tag != "kernel" or ins.view_op is not None:
            continue
        view = _view_of_copy(m, ins)
        y = ins.keyword.get("out")
        if view is not None and y is not None:
            yield (pc, ins.positional[0], y, *view)


def _run_as_view(m: LoadedMethod, pc: int, view_op) -> None:
    """Rewrite copy kernel ``pc`` to bind its output to ``view_op`` of its source."""
    ins = m.instructions[pc]
    m.writes[pc] = set()
    m.instructions[pc] = Kernel("kernel", ins.op, ins.positional[:1] + _view_args(ins), {}, ins.ret_ids, view_op, ins.index, {}, {})


def _view_args(ins) -> list[int]:
    """Positional arguments of the view op: the copy's positional arguments after m."""
    return [] if ins.op is copy_into else list(ins.positional[1:])
