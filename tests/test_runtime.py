"""The runtime on CPU: executor, .ptd mapping, both pool policies, stats and every failure mode."""

import dataclasses
import os
import shutil
import threading

import pytest
import torch

import hostswap
from hostswap.runtime import (
    BudgetError,
    ConcurrentExecutionError,
    LruPool,
    Module,
    ProgramError,
    PtdFile,
    ScheduleDivergenceError,
)
from hostswap.schedules.artifacts import ArtifactError
from hostswap.schedules.floor import aligned
from hostswap.schedules.pte_program import read_program

MB = 2**20


def budgets(schedule):
    total = sum(aligned(b) for b in schedule.weight_bytes)
    return {"floor": schedule.floor_bytes, "half": max(schedule.floor_bytes, (schedule.floor_bytes + total) // 2), "total": total}


@pytest.mark.parametrize("policy", ["lru", "planned"])
@pytest.mark.parametrize("where", ["floor", "half", "total"])
def test_outputs_equal_lowered_program_bitwise(lowered, policy, where):
    budget = budgets(lowered.schedule)[where]
    m = Module(lowered.pte, lowered.ptd, weight_offload_budget_mb=budget / MB, device="cpu", policy=policy)
    try:
        for _ in range(3):  # steady state too: reuse, eviction and ring wrap across forwards
            y = m(*lowered.args)
            assert torch.equal(y, lowered.lowered_expected)
            torch.testing.assert_close(y, lowered.expected, rtol=1e-5, atol=1e-5)
        stats = m.stats
        # the cap holds: device bytes held by weights never exceed the budget
        assert stats["peak_weight_bytes"] <= budget
        assert stats["forwards"] == 3
    finally:
        m.close()


def test_lru_stats_add_up(lowered_by_name):
    demo = lowered_by_name("demo_transformer")
    s = demo.schedule
    m = Module(demo.pte, demo.ptd, weight_offload_budget_mb=s.floor_bytes / MB, device="cpu", policy="lru")
    m(*demo.args)
    m(*demo.args)
    st = m.stats
    pool = m.pool
    loads = st["misses"] + st["prefetches_issued"]
    assert loads > 0 and st["evictions"] > 0
    # bytes copied equal the bytes of every load (misses and prefetches)
    assert st["prefetches_used"] + st["prefetches_wasted"] <= st["prefetches_issued"]
    assert st["hits"] + st["misses"] == 2 * s.num_probes - st["prefetches_used"] + st["prefetches_used"]
    assert st["bytes_h2d"] == hostswap.schedules.policies.lru_streamed_bytes(s, s.floor_bytes, forwards=1) + hostswap.schedules.policies.lru_streamed_bytes(s, s.floor_bytes, forwards=2)
    assert pool.stats.peak_weight_bytes <= s.floor_bytes
    m.close()


def test_planned_streams_only_what_is_not_resident(lowered_by_name):
    demo = lowered_by_name("demo_transformer")
    s = demo.schedule
    for budget in budgets(s).values():
        m = Module(demo.pte, demo.ptd, weight_offload_budget_mb=budget / MB, device="cpu", policy="planned")
        m(*demo.args)
        layout = m.pool.layout
        assert m.stats["bytes_h2d"] == layout.streamed_bytes
        assert layout.streamed_bytes <= sum(s.weight_bytes[w] for w in s.probe_weight if w not in layout.resident)
        m.close()


@pytest.mark.parametrize("depth", [0, 1, 2, 4])
def test_planned_prefetch_counts_streamed_probes(lowered, depth):
    from hostswap.schedules.policies import issue_horizon, plan_layout

    s = dataclasses.replace(lowered.schedule, prefetch_depth=depth)
    for name, budget in budgets(s).items():
        layout = plan_layout(s, budget)
        horizon = issue_horizon(s, layout)
        streamed = [p for p in range(s.num_probes) if s.probe_weight[p] not in layout.resident]
        issued_through = -1
        for p in range(s.num_probes):
            j = s.probe_kernel[p]
            assert horizon[p] >= max(p, issued_through)
            # exactly `depth` streamed probes beyond kernel j, however many resident ones lie between
            ahead = [q for q in streamed if s.probe_kernel[q] > j]
            assert [q for q in ahead if q <= horizon[p]] == ahead[:depth], (name, p)
            # what becomes issuable now overwrites only ring bytes that kernels up to j-2 read
            for q in range(issued_through + 1, horizon[p] + 1):
                if q in layout.fill_offset:
                    assert layout.fill_waits_for[q] <= j - 2 or layout.fill_waits_for[q] == -1, (name, p, q)
            issued_through = horizon[p]


def test_planned_prefetch_runs_ahead_over_resident_weights(lowered_by_name):
    # Between two streamed weights lie resident ones; depth 1 must still copy the next
    # streamed weight before its own probe, so every fill after the first is a prefetch.
    demo = lowered_by_name("demo_transformer")
    s = demo.schedule
    half = budgets(s)["half"]
    m = Module(demo.pte, demo.ptd, weight_offload_budget_mb=half / MB, device="cpu", policy="planned", prefetch_depth=1)
    layout = m.pool.layout
    assert len(layout.resident) > 0 and len(layout.fill_offset) > 2
    gaps = [b - a for a, b in zip(sorted(layout.fill_offset), sorted(layout.fill_offset)[1:])]
    assert max(gaps) > 1  # resident probes separate streamed ones
    assert torch.equal(m(*demo.args), demo.lowered_expected)
    # only a fill at probe 0 can be issued at its own probe: every other one is in the
    # horizon of the probe before it
    misses = 1 if 0 in layout.fill_offset else 0
    assert m.stats["misses"] == misses
    assert m.stats["prefetches_issued"] == len(layout.fill_offset) - misses == m.stats["prefetches_used"]
    m.close()


@pytest.mark.parametrize("depth", [0, 1, 2])
def test_fills_are_issued_as_soon_as_their_ring_bytes_are_released(lowered, depth):
    """Depth >= 1: every ring fill is issued once the last kernel reading the bytes it
    overwrites has been launched, never before (the copy would race that kernel) and not one
    awaited kernel launch later (the copy engine would wait for the host). Depth 0, the
    no-prefetch reference, issues each fill at a probe of the kernel that reads it. Outputs
    stay bitwise."""
    s = dataclasses.replace(lowered.schedule, prefetch_depth=depth)
    total = budgets(s)["total"]
    checked = streaming = 0
    for fraction in (0.0, 0.5, 0.75):
        budget = max(s.floor_bytes, int(fraction * total))
        if budget >= total:
            continue
        m = Module(lowered.pte, lowered.ptd, weight_offload_budget_mb=budget / MB, device="cpu", policy="planned", prefetch_depth=depth)
        pool = m.pool
        waits_for = pool.layout.fill_waits_for
        streaming += bool(waits_for)
        log = []
        launched, issue = pool.kernel_launched, pool._issue_fill
        pool.kernel_launched = lambda k: (log.append(("launch", k)), launched(k))[1]
        pool._issue_fill = lambda q: (log.append(("fill", q, pool._next_probe)), issue(q))[1]
        try:
            for _ in range(2):
                log.clear()
                assert torch.equal(m(*lowered.args), lowered.lowered_expected)
                fills = [e[1] for e in log if e[0] == "fill"]
                assert fills == sorted(waits_for)  # each fill once, in probe order
                done, last = set(), -1
                for e in log:
                    if e[0] == "fill":
                        q = e[1]
                        assert waits_for[q] <= last, (q, waits_for[q], last)
                        if depth == 0:  # at the first probe of the kernel that reads it
                            assert e[2] >= 1 and s.probe_kernel[e[2] - 1] == s.probe_kernel[q], f"depth 0 issued fill {q} at probe {e[2] - 1}"
                        done.add(q)
                    else:
                        pending = [q for q in sorted(waits_for) if q not in done]
                        if depth >= 1 and pending:
                            assert waits_for[pending[0]] > last, f"fill {pending[0]} was released by kernel {waits_for[pending[0]]} but still waited at kernel {e[1]}"
                        last = e[1]
                checked += bool(fills)
        finally:
            m.close()
    assert checked == 2 * streaming
    if lowered.name == "demo_transformer":
        assert streaming


def test_depth_zero_run_ahead_layout_stays_bitwise(lowered):
    """Depth 0 at budgets where the plan places its ring as depth 1 does (policies.plan_layout,
    run-ahead) still issues each copy at its own probe; outputs stay bitwise over forwards."""
    from hostswap.schedules.floor import ring_is_safe
    from hostswap.schedules.policies import _stream_sequence, plan_layout

    s = dataclasses.replace(lowered.schedule, prefetch_depth=0)
    total = budgets(s)["total"]
    ran_ahead = 0
    for fraction in (0.5, 0.75, 0.9):
        budget = max(s.floor_bytes, int(fraction * total))
        layout = plan_layout(s, budget)
        seq, _ = _stream_sequence(s, set(layout.resident))
        if not seq.probe_weight or not ring_is_safe(seq, 1, layout.ring_bytes):
            continue
        ran_ahead += 1
        m = Module(lowered.pte, lowered.ptd, weight_offload_budget_mb=budget / MB, device="cpu", policy="planned", prefetch_depth=0)
        try:
            assert m.pool.layout == layout
            for _ in range(3):
                assert torch.equal(m(*lowered.args), lowered.lowered_expected)
            assert m.stats["bytes_h2d"] == 3 * layout.streamed_bytes
        finally:
            m.close()
    if lowered.name == "demo_transformer":
        assert ran_ahead, "the demo transformer has budgets where depth 0 runs ahead"


def test_error_ring_fill_ahead_of_the_kernel_it_must_wait_for(lowered_by_name):
    # A horizon past what the ring's windows allow would make a fill wait on an event that
    # still holds the previous forward's record; the pool refuses instead of racing.
    demo = lowered_by_name("demo_transformer")
    m = Module(demo.pte, demo.ptd, weight_offload_budget_mb=demo.schedule.floor_bytes / MB, device="cpu", policy="planned")
    m.pool._issue_through = [demo.schedule.num_probes - 1] * demo.schedule.num_probes
    with pytest.raises(ScheduleDivergenceError, match=r"ring fill for probe \d+ \('[\w.]+'\) must wait for kernel \d+, but only kernels up to -1 have been launched"):
        m(*demo.args)
    m.close()


def test_every_pool_counter_is_placed_for_graph_replays():
    """A CUDA-graph replay advances the PoolStats counters in module._REPLAY_COUNTED by what
    its captured forward counted; every other field must be listed, with its reason, in
    _REPLAY_NOT_COUNTED, so that a counter added to PoolStats cannot be left stale silently."""
    from hostswap.runtime import module
    from hostswap.runtime.pool import PoolStats

    fields = {f.name for f in dataclasses.fields(PoolStats)}
    counted, not_counted = set(module._REPLAY_COUNTED), set(module._REPLAY_NOT_COUNTED)
    assert not counted & not_counted
    assert counted | not_counted == fields, f"unplaced: {sorted(fields - counted - not_counted)}, unknown: {sorted((counted | not_counted) - fields)}"


def test_error_prepare_capture_off_planned_cuda(lowered_by_name):
    """prepare_capture (what cuda_graph=True calls before capturing) is only for the planned
    policy on CUDA; called elsewhere it refuses before touching the pool."""
    demo = lowered_by_name("demo_transformer")
    for policy in ("planned", "lru"):
        m = Module(demo.pte, demo.ptd, weight_offload_budget_mb=demo.schedule.floor_bytes / MB, device="cpu", policy=policy)
        try:
            with pytest.raises(RuntimeError, match="prepare_capture is for the planned policy on CUDA"):
                m.pool.prepare_capture()
            assert torch.equal(m(*demo.args), m(*demo.args))
        finally:
            m.close()


def test_constant_methods_readable_and_several_methods(lowered_by_name):
    demo = lowered_by_name("demo_transformer")
    m = Module(demo.pte, demo.ptd, weight_offload_budget_mb=100, device="cpu")
    assert m.run_method("hostswap_forward_floor_bytes", []) == [demo.schedule.floor_bytes]
    assert m.run_method("hostswap_forward_weight_fqns", []) == list(demo.schedule.fqns)
    assert "forward" in m.method_names() and len(m.method_names()) > 5
    with pytest.raises(ProgramError, match="no method 'nope'"):
        m.run_method("nope", [])
    m.close()


def test_ptd_mapping_does_not_read_the_file(lowered_by_name, tmp_path):
    demo = lowered_by_name("demo_transformer")
    ptd = PtdFile(demo.ptd)
    try:
        for fqn in demo.schedule.fqns:
            t = ptd.host_tensor(fqn)
            # a view into the mapping, not a copy
            assert ptd.base_pointer <= t.data_ptr() < ptd.base_pointer + ptd.nbytes
        w = ptd.host_tensor("lm_head.weight")
        assert torch.equal(w, demo.model.lm_head.weight)
        ptd.prefault()
    finally:
        ptd.close()


def test_loading_does_not_grow_resident_memory_by_file_size(tmp_path):
    big = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(16)]).eval()  # 64 MB
    args = (torch.randn(2, 1024),)
    ep = hostswap.apply_weight_offload(torch.export.export(big, args))
    pte, ptd = hostswap.save(ep, tmp_path / "big")
    size = os.path.getsize(ptd)

    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    before = rss()
    m = Module(pte, ptd, weight_offload_budget_mb=20, device="cpu", policy="planned")
    grown = rss() - before
    # the planned arena (20 MB) is allocated; the 64 MB of weights are not read
    assert grown < 20 * MB + size * 0.25, (grown, size)
    assert torch.equal(m(*args), big(*args)) or torch.allclose(m(*args), big(*args))
    m.close()


def test_error_budget_below_floor_names_required_mb(lowered_by_name):
    demo = lowered_by_name("demo_transformer")
    need = -(-demo.schedule.floor_bytes // MB)
    with pytest.raises(BudgetError, match=rf"\({need} MB\) are required"):
        Module(demo.pte, demo.ptd, weight_offload_budget_mb=(demo.schedule.floor_bytes - 1) / MB, device="cpu")


def _copy_pair(src, tmp_path):
    pte = tmp_path / "m.pte"
    shutil.copy(src.pte, pte)
    return pte


def test_error_ptd_missing_weight(lowered_by_name, tmp_path):
    nonuniform, tied = lowered_by_name("nonuniform"), lowered_by_name("tied")
    # the tied model's .ptd lacks every weight of the nonuniform program
    with pytest.raises(ArtifactError, match="weights digest: .* belongs to another program"):
        Module(nonuniform.pte, tied.ptd, weight_offload_budget_mb=10, device="cpu")


def test_error_ptd_shape_dtype_disagreement(tmp_path):
    class M(torch.nn.Module):
        def __init__(self, n, dtype):
            super().__init__()
            self.lin = torch.nn.Linear(8, n).to(dtype)

        def forward(self, x):
            return self.lin(x.to(self.lin.weight.dtype))

    x = (torch.randn(2, 8),)
    a, _ = hostswap.save(hostswap.apply_weight_offload(torch.export.export(M(4, torch.float32), x)), tmp_path / "a")
    _, b_ptd = hostswap.save(hostswap.apply_weight_offload(torch.export.export(M(6, torch.float32), x)), tmp_path / "b")
    # names, dtypes and shapes are in the digest: refused from the index alone
    with pytest.raises(ArtifactError, match=r"b.ptd: weights digest: .* belongs to another program"):
        Module(a, b_ptd, weight_offload_budget_mb=10, device="cpu")
    _, c_ptd = hostswap.save(hostswap.apply_weight_offload(torch.export.export(M(4, torch.float16), x)), tmp_path / "c")
    with pytest.raises(ArtifactError, match=r"c.ptd: weights digest: .* belongs to another program"):
        Module(a, c_ptd, weight_offload_budget_mb=10, device="cpu")


def test_error_not_a_ptd(lowered_by_name, tmp_path):
    bad = tmp_path / "bad.ptd"
    bad.write_bytes(b"x" * 100)
    with pytest.raises(ArtifactError, match="bad.ptd: header: .*not an ExecuTorch .ptd"):
        Module(lowered_by_name("nonuniform").pte, bad, weight_offload_budget_mb=10, device="cpu")


def test_error_pte_not_from_the_pass(tmp_path):
    from executorch.exir import to_edge

    ep = torch.export.export(torch.nn.Linear(4, 4), (torch.randn(1, 4),))
    path = tmp_path / "plain.pte"
    path.write_bytes(to_edge(ep).to_executorch().buffer)
    with pytest.raises(ArtifactError, match="hostswap_schedule_version: is missing: the program was not saved by hostswap.save"):
        Module(path, None, weight_offload_budget_mb=10, device="cpu")


def test_error_probe_sequence_diverges_at_run_time(lowered_by_name):
    demo = lowered_by_name("nonuniform")
    m = Module(demo.pte, demo.ptd, weight_offload_budget_mb=10, device="cpu")
    # simulate a program that asks for the probes in another order than recorded
    ex = m._executors["forward"]
    probes = [i for i, ins in enumerate(ex.instructions) if ins[0] == "probe"]
    a, b = probes[0], probes[2]
    ex.instructions[a], ex.instructions[b] = ex.instructions[b], ex.instructions[a]
    with pytest.raises(ScheduleDivergenceError, match=r"asked for probe 2 \('big.weight'\) where the schedule has probe 0 \('small1.weight'\)"):
        m(*demo.args)
    m.close()


def test_error_concurrent_execution_refused(lowered_by_name):
    demo = lowered_by_name("nonuniform")
    m = Module(demo.pte, demo.ptd, weight_offload_budget_mb=10, device="cpu")
    entered, release = threading.Event(), threading.Event()
    original = m.pool.acquire

    def slow_acquire(probe_id, fqn):
        entered.set()
        release.wait(10)
        return original(probe_id, fqn)

    m.pool.acquire = slow_acquire
    m._executors["forward"].probe_handler = slow_acquire
    t = threading.Thread(target=lambda: m(*demo.args))
    t.start()
    assert entered.wait(10)
    with pytest.raises(ConcurrentExecutionError, match="already executing"):
        m(*demo.args)
    release.set()
    t.join()
    assert torch.equal(m(*demo.args), demo.lowered_expected)  # and it still works afterwards
    m.close()


def test_error_cuda_requested_without_cuda(lowered_by_name):
    if torch.cuda.is_available():
        pytest.skip("has CUDA")
    demo = lowered_by_name("nonuniform")
    with pytest.raises(hostswap.runtime.PoolCreationError, match="cuda"):
        Module(demo.pte, demo.ptd, weight_offload_budget_mb=10, device="cuda")


def test_error_delegate_call_names_backend():
    from types import SimpleNamespace

    from hostswap.runtime.method_loader import LoadedMethod

    ex = LoadedMethod.__new__(LoadedMethod)
    ex.name, ex.reads, ex.writes = "forward", [], []
    ex.plan = SimpleNamespace(delegates=[SimpleNamespace(id="CudaBackend")])

    class DelegateCall:
        delegate_index = 0

    with pytest.raises(ProgramError, match="delegate backend 'CudaBackend'"):
        ex._compile(3, SimpleNamespace(instr_args=DelegateCall()))


def test_zero_element_outputs_get_their_own_storage(lowered_by_name):
    # batch norm's save_mean/save_invstd are planned with 0 bytes; CUDA resizes them to (C,),
    # which must not write into the arena (seen on an H200: wrong ConvNet outputs before this)
    conv = lowered_by_name("convnet")
    m = Module(conv.pte, conv.ptd, weight_offload_budget_mb=10, device="cpu")
    scratch = [ins for ins in m._executors["forward"].instructions if ins[0] == "kernel" and ins[7]]
    assert scratch and all("_native_batch_norm" in str(ins[1]) for ins in scratch)
    m.close()


def test_attention_stays_one_kernel_through_lowering(lowered_by_name):
    demo = lowered_by_name("demo_transformer")
    program = read_program(demo.pte)
    names = {op.name for op in program.execution_plan[0].operators}
    assert "hostswap::sdpa" in names
    # the math decomposition's per-layer mask and softmax are gone
    assert not names & {"aten::_softmax", "aten::bmm", "aten::logical_not"}
    m = Module(demo.pte, demo.ptd, weight_offload_budget_mb=100, device="cpu")
    assert torch.equal(m(*demo.args), demo.expected)
    m.close()


def test_dropout_attention_is_left_to_the_decomposition():
    from hostswap.passes.fused_attention import KeepFusedAttentionPass

    class Attn(torch.nn.Module):
        def forward(self, q):
            return torch.nn.functional.scaled_dot_product_attention(q, q, q, dropout_p=0.5) + torch.nn.functional.scaled_dot_product_attention(q, q, q)

    ep = torch.export.export(Attn(), (torch.randn(1, 2, 4, 8),))
    assert KeepFusedAttentionPass().call(ep.graph_module) == 1
    targets = [str(n.target) for n in ep.graph.nodes if n.op == "call_function"]
    assert targets.count("hostswap.sdpa.default") == 1 and targets.count("aten.scaled_dot_product_attention.default") == 1


@pytest.mark.parametrize("model", ["demo_transformer", "convnet"])
def test_generated_code_equals_interpreter(lowered_by_name, model):
    demo = lowered_by_name(model)
    m = Module(demo.pte, demo.ptd, weight_offload_budget_mb=100, device="cpu")
    generated = m(*demo.args).clone()
    executor = m._executors["forward"]
    assert executor._straight_line[1] is not None  # the generated function ran
    executor.bind_inputs(list(demo.args))  # the arena may have reused the input's bytes
    m.pool.begin_forward()
    executor._interpret(m._probed[m.method_name].on_kernel, m._probed[m.method_name].hooked)
    m.pool.end_forward()
    assert torch.equal(executor.outputs()[0], generated)
    assert torch.equal(generated, demo.expected)
    m.close()


def test_prefetch_depth_override_recomputes_the_floor(lowered_by_name):
    demo = lowered_by_name("demo_transformer")
    deep = dataclasses.replace(demo.schedule, prefetch_depth=4)
    assert deep.floor.lru_bytes > demo.schedule.floor.lru_bytes  # a deeper window holds more weights
    assert deep.floor_bytes != demo.schedule.floor_bytes
    m = Module(demo.pte, demo.ptd, weight_offload_budget_mb=deep.floor_bytes / 2**20, device="cpu", prefetch_depth=4)
    assert m.schedule.prefetch_depth == 4
    assert torch.equal(m(*demo.args), demo.expected)
    m.close()
    with pytest.raises(BudgetError, match="prefetch_depth=4"):
        Module(demo.pte, demo.ptd, weight_offload_budget_mb=(deep.floor_bytes - 1) / 2**20, device="cpu", prefetch_depth=4)


@pytest.mark.parametrize("bad", [-1, 1.5, True, "2", 1025])
def test_error_bad_prefetch_depth_override(lowered_by_name, bad):
    demo = lowered_by_name("nonuniform")
    with pytest.raises(ValueError, match="prefetch_depth must be a non-negative int"):
        Module(demo.pte, demo.ptd, weight_offload_budget_mb=10, device="cpu", prefetch_depth=bad)


def _executor_with_copies(m, planner=None):
    """``m``'s forward loaded again with every copy kept, or with only ``planner``'s views."""
    from hostswap.runtime.executor import MethodExecutor
    from hostswap.runtime.method_loader import LoadedMethod
    from hostswap.schedules.pte_program import plan_by_name

    method = LoadedMethod(m.program, plan_by_name(m.program, "forward"), m.device, weights=m._unprobed_weight)
    return MethodExecutor(method, m.pool.acquire, planner(method) if planner else 0)


@pytest.mark.parametrize("model", ["demo_transformer", "convnet", "tied"])
def test_copy_elision_changes_no_bit(lowered_by_name, model):
    from hostswap.runtime.view_planning import elide_copies

    demo = lowered_by_name(model)
    m = Module(demo.pte, demo.ptd, weight_offload_budget_mb=100, device="cpu")
    elided = m._executors["forward"].elided_copies
    with_elision = m(*demo.args).clone()
    m._executors["forward"] = _executor_with_copies(m)
    assert torch.equal(m(*demo.args), with_elision)
    assert torch.equal(with_elision, demo.expected)
    # ExecuTorch's own plan (no re-planning) elides only copies whose source it leaves alone
    kept_plan = _executor_with_copies(m, elide_copies)
    m._executors["forward"] = kept_plan
    assert torch.equal(m(*demo.args), with_elision)
    assert elided >= kept_plan.elided_copies
    if model == "demo_transformer":
        # under ExecuTorch's plan its copies all feed views folded into memory planning (the
        # reshape after the head transpose reads the clone's bytes under another value), so
        # none may go; re-planned, the head permutes run as views
        assert kept_plan.elided_copies == 0 < elided
    m.close()


def test_copy_elision_on_a_llama_decoder_changes_no_bit(tmp_path):
    from hostswap.models import llama_decoder
    model = llama_decoder(2, hidden=64, intermediate=96, vocab=128, heads=4, max_seq=16, dtype=torch.float32)
    tokens = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(0))
    pte, ptd = hostswap.save(hostswap.apply_weight_offload(torch.export.export(model, (tokens,))), tmp_path / "llama")
    m = Module(pte, ptd, weight_offload_budget_mb=10, device="cpu")
    assert m._executors["forward"].elided_copies > 0
    # every view-like copy runs as a view, the q/k/v transposes included: they read the
    # reshape of the projection's output that ExecuTorch folded into memory planning
    kept = [ins[1]._schema.name for ins in m._executors["forward"].instructions
            if ins[0] == "kernel" and ins[5] is None and getattr(ins[1], "_schema", None) is not None and ins[1]._schema.name.endswith("_copy")]
    assert kept == []
    y = m(tokens).clone()
    m._executors["forward"] = _executor_with_copies(m)
    assert torch.equal(m(tokens), y)
    with torch.no_grad():
        # eager reads some operands through views where the .pte copies them: other CPU
        # kernel paths, so equal to rounding only
        torch.testing.assert_close(y, model(tokens), rtol=1e-5, atol=1e-5)
    m.close()


def test_a_kv_caches_views_read_the_cache_in_place(tmp_path):
    """A GQA decoder's decode step reads each layer's KV cache (program state) through views
    (unsqueeze, expand), as eager PyTorch does, instead of copying the whole cache each step."""
    import transformers as T

    import hostswap.llm as llm

    torch.manual_seed(0)
    config = T.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, max_position_embeddings=32)
    pte, ptd = llm.export(T.LlamaForCausalLM(config).eval(), tmp_path / "m", max_seq_len=16, prefill_chunk=4)
    with Module(pte, ptd, weight_offload_budget_mb=10, device="cpu") as m:
        kept = [ins[1]._schema.name for ins in m._executors["decode"].instructions
                if ins[0] == "kernel" and ins[5] is None and getattr(ins[1], "_schema", None) is not None]
        assert "aten::unsqueeze_copy" not in kept, kept  # before: two whole-cache copies per layer


class _ClonesItsState(torch.nn.Module):
    """Returns a copy of its state taken before it updates the state: the copy must keep the
    old bytes though the program writes the state back before the output is read."""

    def __init__(self):
        super().__init__()
        self.register_buffer("s", torch.zeros(2, 3))
        self.lin = torch.nn.Linear(3, 3)

    def forward(self, x):
        before = self.s.clone().unsqueeze(0)
        self.s.add_(x)
        return before, self.lin(self.s)


def test_a_view_of_state_written_before_its_last_read_stays_a_copy(tmp_path):
    torch.manual_seed(0)
    model, x = _ClonesItsState(), torch.randn(2, 3)
    reference = _ClonesItsState()
    reference.load_state_dict(model.state_dict())
    pte, ptd = hostswap.save(hostswap.apply_weight_offload(torch.export.export(model, (x,))), tmp_path / "m")
    with Module(pte, ptd, weight_offload_budget_mb=1, device="cpu") as m:
        for _ in range(3):  # the state grows each call; each output holds the state before it
            got, expected = m(x), reference(x)
            assert all(torch.equal(g, e) for g, e in zip(got, expected)), (got, expected)


class FirstFitArena:
    """A real first-fit allocator over exactly ``max_bytes`` (as the capped driver pool, it
    fragments): blocks of other sizes freed around live ones need not leave a large enough hole."""

    instances: list = []

    def __init__(self, device, max_bytes):
        self.arena = torch.empty(max_bytes, dtype=torch.uint8, device=device)
        self.free_blocks = [(0, max_bytes)]  # sorted (offset, size)
        self.live: dict[int, int] = {}
        self.refusals = 0
        FirstFitArena.instances.append(self)

    def try_alloc(self, nbytes, stream, stats=None):
        for i, (off, size) in enumerate(self.free_blocks):
            if size >= nbytes:
                self.free_blocks[i : i + 1] = [(off + nbytes, size - nbytes)] if size > nbytes else []
                self.live[off] = nbytes
                return off, self.arena[off : off + nbytes]
        self.refusals += 1
        return None

    def free(self, off, stream):
        blocks = sorted(self.free_blocks + [(off, self.live.pop(off))])
        merged = [blocks[0]]
        for o, n in blocks[1:]:
            if merged[-1][0] + merged[-1][1] == o:
                merged[-1] = (merged[-1][0], merged[-1][1] + n)
            else:
                merged.append((o, n))
        self.free_blocks = merged

    def trim(self, stream, wait):
        pass

    def close(self):
        pass


def test_lru_evicts_past_the_byte_count_when_the_allocator_fragments(lowered_by_name, monkeypatch):
    """Below the total budget a first-fit pool refuses sizes the byte count admits; lru must
    evict further LRU victims until the allocation succeeds, and stay bitwise correct."""
    monkeypatch.setattr(LruPool, "host_allocator_type", FirstFitArena)
    demo = lowered_by_name("demo_transformer")
    s = demo.schedule
    total = sum(aligned(b) for b in s.weight_bytes)
    refused = evicted_extra = 0
    for fraction in (0.55, 0.65, 0.75, 0.85):
        budget = max(s.floor_bytes, int(fraction * total))
        FirstFitArena.instances.clear()
        m = Module(demo.pte, demo.ptd, weight_offload_budget_mb=budget / MB, device="cpu", policy="lru")
        try:
            for _ in range(3):
                assert torch.equal(m(*demo.args), demo.lowered_expected)
            st = m.stats
            assert st["peak_weight_bytes"] <= budget
            arena = FirstFitArena.instances[0]
            assert sum(arena.live.values()) == sum(m.pool.sizes[w] for w in m.pool._handle)
            refused += arena.refusals
            evicted_extra += st["fragmentation_evictions"]
            assert st["fragmentation_evictions"] <= arena.refusals
        finally:
            m.close()
    assert refused > 0 and evicted_extra > 0, "the test model no longer fragments a first-fit pool: pick budgets that do"


def test_lru_names_the_weight_when_fragmentation_leaves_nothing_to_evict(lowered_by_name, monkeypatch):
    """ConvNet at its floor: the current kernel's small weights split a first-fit pool so that
    no hole holds its largest weight. A clear error names it and points to 'planned'."""
    monkeypatch.setattr(LruPool, "host_allocator_type", FirstFitArena)
    conv = lowered_by_name("convnet")
    m = Module(conv.pte, conv.ptd, weight_offload_budget_mb=conv.schedule.floor_bytes / MB, device="cpu", policy="lru")
    with pytest.raises(hostswap.runtime.PoolCreationError, match=r"refused 73728 bytes for 'features.6.weight' at probe \d+ .*fragmented.*policy='planned'"):
        for _ in range(3):  # the first forward starts from an empty pool; steady state fragments
            m(*conv.args)
    # the same budget serves the planned policy, whose layout is fixed at load
    p = Module(conv.pte, conv.ptd, weight_offload_budget_mb=conv.schedule.floor_bytes / MB, device="cpu", policy="planned")
    assert torch.equal(p(*conv.args), conv.lowered_expected)


def test_error_input_of_wrong_shape_loses_nothing(lowered_by_name):
    demo = lowered_by_name("demo_transformer")
    m = Module(demo.pte, demo.ptd, weight_offload_budget_mb=demo.schedule.floor_bytes / MB, device="cpu", policy="planned")
    try:
        first = m(*demo.args)
        forwards = m.stats["forwards"]
        with pytest.raises(ProgramError, match=r"input 0 of shape \(\d+, \d+\) torch.int64 does not match the program's: it takes a tensor of shape \(\d+, \d+\) torch.int64"):
            m(torch.cat([demo.args[0], demo.args[0]], dim=-1))
        with pytest.raises(ProgramError, match=r"input 0 of shape .* torch.int32 does not match"):
            m(demo.args[0].to(torch.int32))
        with pytest.raises(ProgramError, match="takes 1 inputs, got 2"):
            m(*demo.args, *demo.args)
        with pytest.raises(ProgramError, match=r"input 0 is a list; the program takes a tensor of shape"):
            m(demo.args[0].tolist())
        with pytest.raises(ProgramError, match=r"input 0 is on meta; give it on the CPU or a CUDA device"):
            m(demo.args[0].to("meta"))
        assert m.stats["forwards"] == forwards
        assert torch.equal(m(*demo.args), first)
    finally:
        m.close()


def test_error_unknown_policy_and_uncapturable_graph_refused_before_loading(tmp_path, lowered_by_name):
    """A policy name that is not a pool, or cuda_graph=True with a pool that cannot be captured,
    is refused naming the argument before any file is read; off CUDA, before the weights are."""
    missing = tmp_path / "missing.pte"
    with pytest.raises(ValueError, match=r"policy must be one of \('planned', 'lru'\), got 'fifo'"):
        Module(missing, weight_offload_budget_mb=10, device="cpu", policy="fifo")
    with pytest.raises(ValueError, match="cuda_graph=True needs policy='planned' on a CUDA device"):
        Module(missing, weight_offload_budget_mb=10, device="cpu", policy="lru", cuda_graph=True)
    demo = lowered_by_name("demo_transformer")
    with pytest.raises(ValueError, match="cuda_graph=True needs policy='planned' on a CUDA device"):
        Module(demo.pte, tmp_path / "missing.ptd", weight_offload_budget_mb=10, device="cpu", cuda_graph=True)


@pytest.mark.parametrize("budget,message", [
    ("100", r"weight_offload_budget_mb must be a number of MB or 'auto', got '100'"),
    (True, r"weight_offload_budget_mb must be a number of MB or 'auto', got True \(bool\)"),
    (float("nan"), r"finite number of MB above 0, got nan"),
    (float("inf"), r"finite number of MB above 0, got inf"),
    (0, r"finite number of MB above 0, got 0"),
    (-5.0, r"finite number of MB above 0, got -5.0"),
])
def test_error_budget_argument_named_before_any_file_is_read(tmp_path, budget, message):
    with pytest.raises(ValueError, match=message):
        Module(tmp_path / "missing.pte", weight_offload_budget_mb=budget, device="cpu")


@pytest.mark.parametrize("device,message", [
    ("meta", r"device must be a CUDA device or the CPU, got 'meta'"),
    ("gpu0", r"device must name a device such as 'cuda', 'cuda:1' or 'cpu', got 'gpu0'"),
])
def test_error_device_argument_named_before_any_file_is_read(tmp_path, device, message):
    with pytest.raises(ValueError, match=message):
        Module(tmp_path / "missing.pte", weight_offload_budget_mb=10, device=device)


def test_error_none_input_loses_nothing(lowered_by_name):
    demo = lowered_by_name("demo_transformer")
    with Module(demo.pte, demo.ptd, weight_offload_budget_mb=demo.schedule.floor_bytes / MB, device="cpu") as m:
        with pytest.raises(ProgramError, match="input 0 is None; the program takes a tensor there"):
            m(None)
        assert m.stats["forwards"] == 0
        assert torch.equal(m(*demo.args), demo.lowered_expected)


def _arena_views(shape, dtype=torch.float32, fill=7.0):
    """Two tensors of ``shape`` viewed into one larger arena, as the executor plans them."""
    numel = torch.Size(shape).numel()
    arena = torch.full((3 * numel + 5,), fill, dtype=dtype)
    return arena, arena[1 : 1 + numel].view(shape), arena[2 * numel + 3 : 3 * numel + 3].view(shape)


@pytest.mark.parametrize("name, args", [
    ("copy", lambda s: (torch.tensor(2.5),)),
    ("copy", lambda s: (torch.arange(s.shape[-1], dtype=torch.float64),)),  # broadcast and cast
    ("slice_scatter", lambda s: (torch.ones(s.shape[0], 2), 1, 1, 5, 2)),
    ("select_scatter", lambda s: (torch.full((s.shape[0],), 3.0), 1, 2)),
    ("diagonal_scatter", lambda s: (torch.full((min(s.shape),), -1.0), 0, 0, 1)),
])
def test_elementwise_out_kernels_equal_aten_and_leave_the_arena_alone(name, args):
    """copy.out and the *_scatter.out ops write ``out`` from ``self``'s elements alone (ATen's
    functional forms copy the whole storage), with ATen's result, in place too."""
    from hostswap.runtime.instructions import ELEMENTWISE_OUT_OPS

    kernel = ELEMENTWISE_OUT_OPS[(f"aten::{name}", "out")]
    aten = getattr(torch.ops.aten, name).out
    arena, this, out = _arena_views((4, 6))
    this.copy_(torch.arange(24, dtype=torch.float32).view(4, 6))
    extra = args(this)
    expected = aten(this.clone(), *extra, out=torch.empty(4, 6))
    before = arena.clone()
    assert kernel(this, *extra, out=out) is out
    assert torch.equal(out, expected)
    outside = torch.ones_like(arena, dtype=torch.bool)
    outside[2 * 24 + 3 : 3 * 24 + 3] = False
    assert torch.equal(arena[outside], before[outside])  # only out's bytes were written
    arena, this, _ = _arena_views((4, 6))
    this.copy_(torch.arange(24, dtype=torch.float32).view(4, 6))
    assert torch.equal(kernel(this, *extra, out=this), expected)  # out is self: in place

