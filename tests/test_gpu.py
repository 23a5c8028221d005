"""GPU checks (``pytest -m gpu`` on the GPU machine): correctness, cap, overlap, registration, graphs."""

import pytest
import torch

import hostswap
from hostswap.runtime import HostRegistrationError, Module, PtdFile
from hostswap.runtime.ptd import _cudart, register_host_memory
from hostswap.schedules.floor import aligned

pytestmark = pytest.mark.gpu
MB = 2**20


def _budgets(s):
    total = sum(aligned(b) for b in s.weight_bytes)
    return [s.floor_bytes, max(s.floor_bytes, (s.floor_bytes + total) // 2), total]


def _cuda_reference(lowered):
    """Plain PyTorch on the same GPU (cuDNN convolutions use TF32 there, as in the runtime)."""
    import copy

    with torch.no_grad():
        return copy.deepcopy(lowered.model).cuda()(*[a.cuda() for a in lowered.args]).cpu()


@pytest.mark.parametrize("policy", ["lru", "planned"])
def test_cuda_outputs_match_and_cap_holds(lowered, policy):
    reference = _cuda_reference(lowered)
    for budget in _budgets(lowered.schedule):
        m = Module(lowered.pte, lowered.ptd, weight_offload_budget_mb=budget / MB, device="cuda", policy=policy)
        args = [a.cuda() for a in lowered.args]
        for _ in range(3):
            y = m(*args)
        torch.testing.assert_close(y.cpu(), reference, rtol=1e-4, atol=1e-4)
        st = m.stats
        assert st["peak_weight_bytes"] <= budget
        if policy == "lru":
            cudart = m.pool.allocator.cudart
            err, high = cudart.cudaMemPoolGetAttribute(m.pool.allocator.pool, cudart.cudaMemPoolAttr.cudaMemPoolAttrReservedMemHigh)
            print(f"{policy} budget={budget} pool reserved high={int(high)} stats={st}")
        else:
            print(f"{policy} budget={budget} stats={st}")
        m.close()


def test_registration_works_and_refusal_is_reported(lowered_by_name):
    demo = lowered_by_name("demo_transformer")
    ptd = PtdFile(demo.ptd)
    ptd.register_with_cuda()
    cudart = _cudart()
    err, attrs = cudart.cudaPointerGetAttributes(ptd.base_pointer)
    assert err == cudart.cudaError_t.cudaSuccess
    assert attrs.type == cudart.cudaMemoryType.cudaMemoryTypeHost, attrs.type
    # registering the same range again is refused, with the CUDA error named, and no sticky error remains
    with pytest.raises(HostRegistrationError, match="cudaErrorHostMemoryAlreadyRegistered"):
        register_host_memory(ptd.base_pointer, ptd.nbytes, what=demo.ptd)
    torch.zeros(1, device="cuda").add_(1)  # the next CUDA call is unaffected
    ptd.close()


def test_copies_overlap_compute_on_two_streams(tmp_path):
    # Enough compute per weight that prefetch copies run under kernels.
    model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(12)]).eval()
    x = torch.randn(4096, 2048)
    ep = hostswap.apply_weight_offload(torch.export.export(model, (x,)), prefetch_depth=2)
    pte, ptd = hostswap.save(ep, tmp_path / "mlp")
    s = hostswap.schedules.load_weight_schedule(pte)
    m = Module(pte, ptd, weight_offload_budget_mb=s.floor_bytes / MB, device="cuda", policy="planned")
    xc = x.cuda()
    m(xc)
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        y = m(xc)
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type.name == "CUDA"]
    copies = [e for e in events if "HtoD" in e.name]
    kernels = [e for e in events if "Memcpy" not in e.name and "Memset" not in e.name]
    copy_streams = {getattr(e, "device_resource_id", None) for e in copies}
    kernel_streams = {getattr(e, "device_resource_id", None) for e in kernels}
    overlap = 0.0
    for c in copies:
        for k in kernels:
            lo, hi = max(c.time_range.start, k.time_range.start), min(c.time_range.end, k.time_range.end)
            overlap += max(0, hi - lo)
    copy_time = sum(c.time_range.end - c.time_range.start for c in copies)
    print(f"copies={len(copies)} on streams {copy_streams}, kernels on {kernel_streams}, copy time {copy_time:.0f} us, overlapped {overlap:.0f} us")
    assert copies and copy_streams.isdisjoint(kernel_streams)
    assert overlap > 0.3 * copy_time
    torch.testing.assert_close(y.cpu(), model(x), rtol=1e-3, atol=1e-3)
    m.close()


def test_cuda_graph_replays_correctly(lowered_by_name):
    demo = lowered_by_name("demo_transformer")
    s = demo.schedule
    m = Module(demo.pte, demo.ptd, weight_offload_budget_mb=s.floor_bytes / MB, device="cuda", policy="planned", cuda_graph=True)
    args = [a.cuda() for a in demo.args]
    first = m(*args).clone()
    again = m(*args)
    torch.testing.assert_close(again.cpu(), demo.expected, rtol=1e-4, atol=1e-4)
    assert torch.equal(first, again)
    other = torch.randint(0, 4096, demo.args[0].shape, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = demo.model(other)
    torch.testing.assert_close(m(other.cuda()).cpu(), want, rtol=1e-4, atol=1e-4)
    m.close()


@pytest.mark.parametrize("forced", [True, False])
def test_cuda_graph_carries_fills_between_replays(lowered_by_name, monkeypatch, forced):
    """Under cuda_graph=True each replay copies the next one's first fills at its end and skips
    them at its start (pool.prepare_capture). Forced: every carry-able fill is carried. Replays
    back to back with no synchronisation, inputs alternating, launched from two streams:
    every output is bitwise the all-resident one, and every replay copies the plan's bytes."""
    from hostswap.runtime.planned_pool import PlannedPool

    demo = lowered_by_name("demo_transformer")
    s = demo.schedule
    inputs = [demo.args[0].cuda(), torch.randint(0, 4096, demo.args[0].shape, generator=torch.Generator().manual_seed(5)).cuda()]
    resident = Module(demo.pte, demo.ptd, weight_offload_budget_mb=s.total_bytes / MB, device="cuda")
    expected = [resident(x).clone() for x in inputs]
    resident.close()
    if forced:
        monkeypatch.setattr(PlannedPool, "_decide_carry", lambda self: setattr(self, "_carry_count", len(self._carry_order)))
    m = Module(demo.pte, demo.ptd, weight_offload_budget_mb=s.floor_bytes / MB, device="cuda", policy="planned", cuda_graph=True)
    try:
        m(inputs[0])  # capture
        if forced:
            assert m.pool._carry_count == len(m.pool._carry_order) > 0
        before = m.stats
        other = torch.cuda.Stream()
        outs = []
        for i in range(8):
            other.wait_stream(torch.cuda.current_stream())  # the last clone has read the outputs
            with torch.cuda.stream(other if i % 3 == 2 else torch.cuda.current_stream()):
                y = m(inputs[i % 2]).clone()
            torch.cuda.current_stream().wait_stream(other)
            outs.append(y)
        for i, y in enumerate(outs):
            assert torch.equal(y, expected[i % 2]), i
        after = m.stats
        assert after["forwards"] - before["forwards"] == 8
        assert after["bytes_h2d"] - before["bytes_h2d"] == 8 * m.pool.layout.streamed_bytes
        assert after["fills_carried"] - before["fills_carried"] == 8 * m.pool._carry_count
        print(f"forced={forced}: {m.pool._carry_count} of {len(m.pool._carry_order)} carry-able fills carried per replay")
    finally:
        m.close()


def test_cuda_graph_captures_with_stall_timings_unread(lowered_by_name, monkeypatch):
    """Stall timing events recorded by eager forwards and not yet read must not be queried
    while the graph is captured (a query invalidates the capture, and the forward would fail).
    A wait on a long copy leaves such a pair."""
    from hostswap.runtime.planned_pool import PlannedPool

    demo = lowered_by_name("demo_transformer")
    s = demo.schedule
    source = torch.empty(256 * MB, dtype=torch.uint8, pin_memory=True)
    target = torch.empty(256 * MB, dtype=torch.uint8, device="cuda")
    prepare = PlannedPool.prepare_capture

    def prepare_then_stall(pool):  # between the eager warm-ups and the capture
        prepare(pool)
        pool.streams.compute_waits(pool.streams.copy(target, source))
        assert pool.streams._stall_pairs, "the wait on a 256 MiB copy did not stall"

    monkeypatch.setattr(PlannedPool, "prepare_capture", prepare_then_stall)
    m = Module(demo.pte, demo.ptd, weight_offload_budget_mb=s.floor_bytes / MB, device="cuda", policy="planned", cuda_graph=True)
    try:
        y = m(demo.args[0].cuda())  # warm-ups, prepare_capture, capture, first replay
        torch.testing.assert_close(y.cpu(), demo.expected, rtol=1e-4, atol=1e-4)
        assert torch.equal(m(demo.args[0].cuda()), y)
        assert m.stats["stall_seconds"] > 0
    finally:
        m.close()


def test_refused_input_leaves_planned_forwards_intact(lowered_by_name):
    """The first ring fills are issued before the inputs are bound (runtime/planned_pool.py
    begin_forward); an input the program refuses is refused before that, so the module keeps
    streaming exactly its plan and its outputs stay bitwise."""
    demo = lowered_by_name("demo_transformer")
    s = demo.schedule
    m = Module(demo.pte, demo.ptd, weight_offload_budget_mb=s.floor_bytes / MB, device="cuda", policy="planned")
    try:
        args = [a.cuda() for a in demo.args]
        first = m(*args)
        assert m.stats["bytes_h2d"] - m.stats["bytes_carried"] == m.pool.layout.streamed_bytes > 0
        before = m.stats["bytes_h2d"]
        bad = [torch.cat([args[0], args[0]], dim=-1)]
        with pytest.raises(hostswap.runtime.ProgramError, match="does not match the program's"):
            m(*bad)
        assert m.stats["bytes_h2d"] == before  # nothing was copied for the refused call
        assert torch.equal(m(*args), first)
    finally:
        m.close()


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("forced", [True, False])
def test_carried_fills_stay_bitwise(lowered_by_name, monkeypatch, depth, forced):
    """Fills issued at the end of a forward for the next (runtime/planned_pool.py, _carry_fills) overwrite ring
    bytes the finishing forward's last kernels still read, after waiting for them. Forced: every
    carry-able fill is carried at every forward, kernels of the forward still queued; else the
    pool decides from the measured tail. Outputs stay bitwise equal to all-resident, and in
    steady state a forward copies exactly the plan's bytes."""
    from hostswap.runtime.planned_pool import PlannedPool

    demo = lowered_by_name("demo_transformer")
    s = demo.schedule
    args = [a.cuda() for a in demo.args]
    resident = Module(demo.pte, demo.ptd, weight_offload_budget_mb=s.total_bytes / MB, device="cuda")
    expected = resident(*args)
    resident.close()
    if forced:
        monkeypatch.setattr(PlannedPool, "_decide_carry", lambda self: setattr(self, "_carry_count", len(self._carry_order)))
    m = Module(demo.pte, demo.ptd, weight_offload_budget_mb=s.floor_bytes / MB, device="cuda", policy="planned", prefetch_depth=depth)
    try:
        if forced:
            assert m.pool._carry_order, "the plan has no fill to carry"
        for i in range(6):
            y = m(*args)  # no synchronisation between forwards: carried copies race the last kernels
            assert torch.equal(y, expected), i
        # Unforced, the carry is decided anew from each forward's timing: the fills carried out
        # of the window's last forward need not be those carried into its first.
        def carried_bytes():
            return sum(s.weight_bytes[s.probe_weight[q]] for q in m.pool._carried)

        before, carried_in = m.stats, carried_bytes()
        for _ in range(3):
            m(*args)
        after, carried_out = m.stats, carried_bytes()
        assert after["bytes_h2d"] - before["bytes_h2d"] == 3 * m.pool.layout.streamed_bytes + carried_out - carried_in
        if forced:
            assert after["fills_carried"] - before["fills_carried"] == 3 * len(m.pool._carry_order)
        print(f"depth {depth} forced={forced}: carried {after['fills_carried']} fills, {after['bytes_carried']} bytes")
    finally:
        m.close()


def test_generation_on_cuda_equals_transformers_and_graphed_decode_is_bitwise_eager(tmp_path):
    """A transformers Llama (fp32, random weights) saved and loaded back: greedy tokens on the
    GPU at the floor are transformers' own (static cache, same GPU), and decode under a CUDA
    graph gives bitwise the logits of eager decode."""
    import hostswap.llm as llm
    from hostswap.models import tiny_llama
    from transformers import AutoModelForCausalLM, GenerationConfig

    tiny_llama().save_pretrained(tmp_path / "ckpt")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt").eval()
    pte, ptd = llm.export(model, tmp_path / "llama", max_seq_len=96, prefill_chunk=16)
    floor = max(s.floor_bytes for s in hostswap.schedules.load_weight_schedules(pte).values())
    prompt = torch.randint(0, 4096, (1, 20), generator=torch.Generator().manual_seed(2))
    reference = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt").eval().cuda()
    reference.generation_config = GenerationConfig(cache_implementation="static", cache_config={"batch_size": 1, "max_cache_len": 96},
                                                   do_sample=False, max_new_tokens=64, min_new_tokens=64, pad_token_id=0)
    with torch.no_grad():
        expected = reference.generate(prompt.cuda()).cpu()
    logits = {}
    for graphed in (True, False):
        with llm.Generator(pte, ptd, weight_offload_budget_mb=floor / MB, device="cuda", cuda_graph=graphed) as g:
            out = g.generate(prompt, 64)
            assert torch.equal(out, expected), (graphed, out[0, 20:].tolist(), expected[0, 20:].tolist())
            assert g.module.stats["bytes_h2d"] > 0
            steps = [g.module.run_method("decode", [out[:, 20 + i : 21 + i], torch.tensor([84 + i])])[0] for i in range(4)]
            logits[graphed] = torch.stack(steps)
            print(f"cuda_graph={graphed}: {g.summary()}")
    assert torch.equal(logits[True], logits[False])


def test_bf16_generation_is_bitwise_the_same_at_every_budget_and_run(tmp_path):
    """bf16 decode reads the same weights through the same kernels at every budget: tokens and
    logits are bitwise equal across budgets and across two loads at one budget. A transformers
    Llama with the benchmark's layer shapes (hidden 2048, GQA 32/8, intermediate 5632), 2 layers."""
    import hostswap.llm as llm
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=2, num_attention_heads=32,
                         num_key_value_heads=8, max_position_embeddings=512, bos_token_id=None, eos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    pte, ptd = llm.export(model, tmp_path / "llama", max_seq_len=128, prefill_chunk=32)
    schedule = hostswap.schedules.load_weight_schedule(pte, "decode")
    prompt = torch.randint(0, 32000, (1, 40), generator=torch.Generator().manual_seed(3))
    runs = {}
    for name, budget in (("floor", schedule.floor_bytes), ("50%", schedule.total_bytes // 2), ("100%", schedule.total_bytes + MB), ("100% again", schedule.total_bytes + MB)):
        with llm.Generator(pte, ptd, weight_offload_budget_mb=max(budget, schedule.floor_bytes) / MB, device="cuda") as g:
            out = g.generate(prompt, 48)
            steps = [g.module.run_method("decode", [out[:, 40 + i : 41 + i], torch.tensor([88 + i])])[0] for i in range(4)]
            runs[name] = (out, torch.stack(steps).cpu())
            print(f"{name}: {g.summary()}")
    reference_tokens, reference_logits = runs["100%"]
    for name, (tokens, logits) in runs.items():
        differ = (tokens != reference_tokens).nonzero()
        print(f"{name}: tokens {'same' if differ.numel() == 0 else f'differ from position {differ[0, 1].item()}'}, "
              f"decode logits {'bitwise' if torch.equal(logits, reference_logits) else f'max diff {(logits.float() - reference_logits.float()).abs().max().item():.3g}'}")
    for name, (tokens, logits) in runs.items():
        assert torch.equal(tokens, reference_tokens), name
        assert torch.equal(logits, reference_logits), name


def test_only_streamed_weights_are_pinned_and_close_frees_the_device(lowered_by_name):
    """The host pages registered are those of the weights streamed after load: none when all is
    resident. close() hands back every byte the Module allocated on the device."""
    import gc

    demo = lowered_by_name("demo_transformer")
    s = demo.schedule
    # A first load, run and close leaves what the process keeps for good (the cuBLAS
    # workspace of the stream, 33 MiB on an H100); a second must hand back all it took.
    with Module(demo.pte, demo.ptd, weight_offload_budget_mb=s.floor_bytes / MB, device="cuda") as warm:
        warm(*[a.cuda() for a in demo.args])
    gc.collect()  # what earlier tests left for the collector goes now, not in the middle
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    gc.disable()  # close() alone must hand the memory back
    try:
        streamed = _streamed_and_closed(demo, s, before)
    finally:
        gc.enable()
    with Module(demo.pte, demo.ptd, weight_offload_budget_mb=(s.total_bytes + MB) / MB, device="cuda") as resident:
        # all resident: only the tables that row gathers read in place stay registered
        tables = sum(s.host_read_bytes)
        assert tables <= resident.stats["pinned_host_bytes"] <= tables + 2 * 4096 * len(s.host_read)
        assert torch.equal(resident(*[a.cuda() for a in demo.args]).cpu(), streamed)  # the same kernels: bitwise


def _streamed_and_closed(demo, s, before):
    m = Module(demo.pte, demo.ptd, weight_offload_budget_mb=s.floor_bytes / MB, device="cuda", policy="planned")
    streamed = [s.fqns[w] for w in m.pool.streamed_weights()] + list(s.host_read)
    streamed_bytes = sum(m.ptd.entries[f].nbytes for f in streamed)
    pinned = m.stats["pinned_host_bytes"]
    print(f"floor: {len(streamed)} of {len(s.fqns)} weights streamed, {streamed_bytes} bytes; pinned {pinned} bytes; file {m.ptd.nbytes} bytes")
    assert streamed_bytes <= pinned <= streamed_bytes + 2 * 4096 * len(streamed)
    assert pinned < m.ptd.nbytes
    y = m(*[a.cuda() for a in demo.args]).cpu()
    assert torch.cuda.memory_allocated() > before
    m.close()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before, (torch.cuda.memory_allocated(), before)
    return y


def test_offload_adamw_on_cuda_matches_adamw_and_keeps_its_state_on_the_host():
    """Bitwise torch.optim.AdamW over 20 steps; the state stays in pinned host memory, and a
    step holds at most three chunks of it on the device (64 times less than the state here)."""
    from hostswap.optim import OffloadAdamW

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024)).cuda()

    chunk = 2**20
    ours, theirs = model(), model()
    opt = OffloadAdamW(ours.parameters(), lr=1e-3, chunk_bytes=chunk)
    ref = torch.optim.AdamW(theirs.parameters(), lr=1e-3, foreach=False)
    peaks = []
    for step in range(20):
        x = torch.randn(64, 1024, device="cuda", generator=torch.Generator("cuda").manual_seed(step))
        for m, o in ((ours, opt), (theirs, ref)):
            o.zero_grad()
            m(x).pow(2).mean().backward()
            if o is opt:
                torch.cuda.synchronize()
                before = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
            o.step()
            if o is opt:
                peaks.append(torch.cuda.max_memory_allocated() - before)
    for a, b in zip(ours.parameters(), theirs.parameters()):
        assert torch.equal(a, b)
    state = opt.state[next(ours.parameters())]
    assert state["exp_avg"].device.type == "cpu" and state["exp_avg"].is_pinned()
    assert opt.host_bytes == 2 * 4 * sum(p.numel() for p in ours.parameters())
    # three buffers of a chunk, and the update's temporaries of one piece
    assert max(peaks) <= 6 * chunk < opt.host_bytes / 8, (max(peaks), opt.host_bytes)
    print(f"OffloadAdamW: {opt.stats}; step peak {max(peaks) / 2**20:.1f} MiB for {opt.host_bytes / 2**20:.0f} MiB of state")


def test_offload_grads_on_cuda_matches_and_frees_the_gradients():
    """offload_grads on CUDA: gradients copied to pinned host memory on their own stream during
    the backward, .grad dropped (the memory after backward is that of no gradients), the same
    parameters as reading .grad on the device, bitwise, over 10 steps."""
    from hostswap.optim import OffloadAdamW

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024)).cuda()

    # the process's first matmuls allocate cuBLAS's workspace (tens of MiB), which would count as held
    model()(torch.randn(64, 1024, device="cuda")).sum().backward()
    ours, theirs = model(), model()
    opt = OffloadAdamW(ours.parameters(), lr=1e-3, chunk_bytes=2**20, offload_grads=True)
    ref = OffloadAdamW(theirs.parameters(), lr=1e-3, chunk_bytes=2**20)
    grads = sum(p.numel() * p.element_size() for p in ours.parameters())
    for step in range(10):
        x = torch.randn(64, 1024, device="cuda", generator=torch.Generator("cuda").manual_seed(step))
        ref.zero_grad()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        ours(x).pow(2).mean().backward()
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated() - before
        assert all(p.grad is None for p in ours.parameters()) and held < grads / 4, (held, grads)
        theirs(x).pow(2).mean().backward()
        opt.step()
        ref.step()
    for a, b in zip(ours.parameters(), theirs.parameters()):
        assert torch.equal(a, b)
    assert all(t.is_pinned() for t in opt._host_grads.values())


def test_offload_context_on_cuda_lowers_the_memory_after_forward_and_keeps_gradients():
    """Eager activation offload of 4 of 8 transformers Llama layers on the GPU: less memory held
    after the forward, gradients those without offload."""
    import hostswap.activations as activations
    from transformers import LlamaConfig, LlamaForCausalLM

    def model():
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=1024, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
                             num_key_value_heads=4, max_position_embeddings=2048)
        return LlamaForCausalLM(config).cuda().train()

    ids = torch.randint(0, 1024, (2, 1024), device="cuda", generator=torch.Generator("cuda").manual_seed(1))

    def step(m, offload):
        inner = m.model
        h = inner.embed_tokens(ids)
        positions = torch.arange(ids.shape[1], device="cuda").unsqueeze(0)
        rotary = inner.rotary_emb(h, positions)
        for i, layer in enumerate(inner.layers):
            with offload.layer(i) if offload is not None else torch.enable_grad():
                h = layer(h, attention_mask=None, position_embeddings=rotary, position_ids=positions)
                h = h[0] if isinstance(h, tuple) else h
        loss = m.lm_head(inner.norm(h)).float().logsumexp(-1).mean()
        torch.cuda.synchronize()
        after_forward = torch.cuda.memory_allocated()
        loss.backward()
        return after_forward, {n: p.grad for n, p in m.named_parameters()}

    plain_memory, expected = step(model(), None)
    offload = activations.OffloadContext(model_layers=8, num_layers=4)
    memory, grads = step(model(), offload)
    print(f"after forward: no offload {plain_memory / 2**20:.0f} MiB, 4 of 8 layers offloaded {memory / 2**20:.0f} MiB; {offload.stats['bytes_offloaded'] / 2**20:.0f} MiB offloaded")
    assert memory < plain_memory
    # attention's backward on CUDA may reduce in any order: equal to rounding, bitwise reported
    bitwise = all(torch.equal(grads[n], g) for n, g in expected.items())
    print(f"gradients bitwise: {bitwise}")
    for name, g in expected.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-6, msg=name)


def test_offload_context_fits_its_reload_points_on_cuda_from_events():
    """reload_ahead='auto' on the GPU: each layer's backward timed by CUDA events, each reload by
    its copy's events; the fitted dictionary is valid, never reloads later than one layer ahead,
    and the steps after the fit keep the gradients of the steps before it."""
    import hostswap.activations as activations
    from hostswap.schedules.sync_dict import default_sync_dict, validate_sync_dict
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=1024, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
                         num_key_value_heads=4, max_position_embeddings=2048)
    model = LlamaForCausalLM(config).cuda().train()
    ids = torch.randint(0, 1024, (4, 1024), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    offload = activations.OffloadContext(model_layers=8, num_layers=4, reload_ahead="auto")
    offload.attach(model.model.layers)
    grads = []
    for step in range(5):
        model.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    offload.detach()
    print(f"backward ms per layer {({j: round(s * 1e3, 2) for j, s in offload._backward_s.items()})}, "
          f"reload ms {({i: round(s * 1e3, 2) for i, s in offload._reload_s.items()})}, headroom MiB {({j: b >> 20 for j, b in offload._headroom.items()})}, "
          f"fitted {offload.synchronization_dict}")
    assert sorted(offload._backward_s) == list(range(1, 8)) and all(s > 0 for s in offload._backward_s.values())
    assert sorted(offload._reload_s) == list(range(4)) and all(s > 0 for s in offload._reload_s.values())
    # the allocator's count at each backward start bounds how early a reload may come
    assert offload._headroom is not None and sorted(offload._headroom) == list(range(7))
    assert sorted(offload._reload_bytes) == list(range(4)) and all(b > 0 for b in offload._reload_bytes.values())
    fitted = validate_sync_dict(offload.synchronization_dict, 8)
    lean = default_sync_dict(8, 4, reload_ahead=1)
    assert all(fitted[i][3] >= lean[i][3] for i in fitted)
    for name, g in grads[1].items():  # before the fit (step 1) and after it (step 4): the same arithmetic
        torch.testing.assert_close(grads[4][name], g, rtol=1e-4, atol=1e-6, msg=name)


def test_offload_context_around_compiled_layers_on_cuda_saves_what_it_offloads():
    """Layers compiled with AOTAutograd inside OffloadContext on the GPU (4 of 8 transformers
    Llama layers offloaded, one layer ahead): the step's peak falls by at least 0.9 of the bytes
    offloaded, and the gradients are bitwise those of the same compiled layers without offload.
    (A whole model under torch.compile with the context attached fails in AOTAutograd on CUDA:
    'Mutations on inputs with user-specified streams are not yet supported', pytorch#172522.)"""
    import hostswap.activations as activations
    from transformers import LlamaConfig, LlamaForCausalLM

    ids = torch.randint(0, 1024, (4, 1024), device="cuda", generator=torch.Generator("cuda").manual_seed(1))

    def run(offload):
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=1024, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
                             num_key_value_heads=4, max_position_embeddings=2048)
        model = LlamaForCausalLM(config).cuda().train()
        if offload is not None:
            offload.attach(model.model.layers)
        for layer in model.model.layers:
            layer.forward = torch.compile(layer.forward, backend="aot_eager")
        for _ in range(3):  # compile, pinned buffers; the last step is measured
            model.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            start = torch.cuda.memory_allocated()
            model(input_ids=ids, labels=ids).loss.backward()
            torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - start, {n: p.grad for n, p in model.named_parameters()}

    torch._dynamo.reset()
    plain, expected = run(None)
    torch._dynamo.reset()
    offload = activations.OffloadContext(model_layers=8, num_layers=4, reload_ahead=1)
    peak, grads = run(offload)
    torch._dynamo.reset()
    offloaded = offload.stats["bytes_offloaded"]
    print(f"compiled layers, peak over the step: {plain / 2**20:.0f} MiB, with 4 of 8 offloaded {peak / 2**20:.0f} MiB ({offloaded / 2**20:.0f} MiB offloaded)")
    assert plain - peak >= 0.9 * offloaded > 0
    for name, g in expected.items():
        assert torch.equal(grads[name], g), name


def _quantized_llama(scheme: str, device: str):
    """A transformers Llama (random weights, 3 layers, hidden 1024: whole groups of 128 and no
    padding in the int4 layout) on ``device``: bf16 linear weights, quantized to ``scheme``
    with hostswap.llm.quantize; embeddings, norms and activations fp32. Returns the model and
    the bytes it would have in bf16."""
    import hostswap.llm as llm
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=512, hidden_size=1024, intermediate_size=2048, num_hidden_layers=3, num_attention_heads=8,
                         num_key_value_heads=4, max_position_embeddings=256, bos_token_id=None, eos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).eval()
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.to(torch.bfloat16)
    bf16_bytes = sum(p.numel() * 2 for p in model.parameters())
    return llm.quantize(model, scheme), bf16_bytes


# the quantized share of the bf16 bytes (int4: half a byte a weight, and a bf16 scale and zero
# point per 128; the fp32 embedding stays) and the first step's logits' tolerance, relative
# to the largest (int4's kernel returns bf16: one rounding step of it)
QUANTIZED_SHARE = {"int8": 0.55, "int4": 0.31}
LOGIT_TOLERANCE = {"int8": 1e-4, "int4": 2**-7}


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantized_generation_on_cuda_is_the_quantized_models_and_streams_its_bytes(tmp_path, scheme, device="cuda"):
    """torchao int8 (Int8WeightOnlyConfig) and int4 (Int4WeightOnlyConfig, tile_packed_to_4d:
    PyTorch's tinygemm kernel), quantized on the GPU by hostswap.llm.quantize, exported and
    generated at the floor and all-resident: (a) greedy tokens are the quantized eager model's
    (transformers generate, static cache, the same GPU), (b) the first step's logits match its
    own to the tolerance above, the same at both budgets, (c) every weight a schedule counts
    is a parameter of the quantized model at its own bytes, so the total and the floor are the
    quantized bytes' (against the same order counted in bf16). Linear weights are bf16 (what
    int4's kernel takes); the rest is fp32, so that eager and the traced program agree to fp32
    rounding outside the quantized linears, which run the same torchao kernels on the same
    bytes: greedy tokens are then a stable check (bf16 random-weight logits are near ties that
    rounding flips; README, Limitations)."""
    import copy

    import hostswap.llm as llm
    from quantized_schedules import bf16_equivalent, own_bytes, quantized_linears
    from transformers import GenerationConfig

    model, bf16_bytes = _quantized_llama(scheme, device)
    reference = copy.deepcopy(model)
    pte, ptd = llm.export(model, tmp_path / scheme, max_seq_len=64, prefill_chunk=16)
    prompt, new = torch.randint(0, 512, (1, 20), generator=torch.Generator().manual_seed(4)), 24
    config = GenerationConfig(do_sample=False, pad_token_id=0, disable_compile=True, cache_implementation="static",
                              cache_config={"batch_size": 1, "max_cache_len": 64}, output_logits=True, return_dict_in_generate=True,
                              max_new_tokens=new, min_new_tokens=new)
    with torch.no_grad():
        out = reference.generate(prompt.to(device), generation_config=config)
    expected, expected_first = out.sequences.cpu(), out.logits[0][0].float().cpu()

    schedules = hostswap.schedules.load_weight_schedules(pte)
    floor, total = max(s.floor_bytes for s in schedules.values()), max(s.total_bytes for s in schedules.values())
    runs = {}
    for name, budget in (("floor", floor), ("all-resident", total + MB)):
        with llm.Generator(pte, ptd, weight_offload_budget_mb=budget / MB, device=device) as g:
            first = llm.prefill(g._step, prompt, g.prefill_chunks, g.max_seq_len).float().cpu()
            tokens = g.generate(prompt, new)
            runs[name] = (tokens, first, g.stats["bytes_streamed_per_token"])
            print(f"{scheme} {name}: {g.summary()}")
    largest = expected_first.abs().max().item()
    for name, (tokens, first, _) in runs.items():
        assert torch.equal(tokens, expected), (scheme, name, tokens[0, 20:].tolist(), expected[0, 20:].tolist())
        diff = (first - expected_first).abs().max().item()
        print(f"{scheme} {name}: first-step logits max |difference| {diff:.3g} (largest logit {largest:.3g})")
        assert diff <= LOGIT_TOLERANCE[scheme] * largest, (
            f"{scheme} at the {name} budget: the first step's logits differ from the quantized eager model's by up to {diff:.3g} "
            f"(tolerance {LOGIT_TOLERANCE[scheme] * largest:.3g}, largest logit {largest:.3g})")
    assert torch.equal(runs["floor"][1], runs["all-resident"][1])
    assert runs["floor"][2] > 0 and runs["all-resident"][2] == 0

    linears = quantized_linears(model)
    assert len(linears) == 3 * 7 + 1
    own = own_bytes(model, "model.")
    for method, s in schedules.items():
        sizes = dict(zip(s.fqns, s.weight_bytes))
        assert sizes == {fqn: own[fqn] for fqn in sizes}, method
        inner = {f"model.{name}.{n}" for name, m in linears.items() for n in m.inner_names}
        assert inner <= set(sizes), method
        qdata = sum(own[f"model.{name}.weight_qdata"] for name in linears)
        weights = sum(m.out_features * m.in_features for m in linears.values())
        assert qdata == {"int8": weights, "int4": weights // 2}[scheme]
        bf16 = bf16_equivalent(s, model, "model.")
        print(f"{scheme} {method}: total {s.total_bytes} bytes ({s.total_bytes / bf16_bytes:.3f} of bf16), floor {s.floor_bytes} "
              f"({s.floor_bytes / bf16.floor_bytes:.3f} of the same order in bf16)")
        assert s.total_bytes < QUANTIZED_SHARE[scheme] * bf16_bytes, (method, s.total_bytes, bf16_bytes)
        assert s.floor_bytes < QUANTIZED_SHARE[scheme] * bf16.floor_bytes, (method, s.floor_bytes, bf16.floor_bytes)


def test_embedding_table_is_read_in_place_on_cuda(tmp_path):
    """The token and position tables stay in the registered mapping: the gather kernel reads
    their rows over the bus, eagerly and inside a CUDA graph, and the output is bitwise that
    of the same program streaming the tables through the pool."""
    from hostswap import models

    model, args = models.demo_transformer(random_state=0)
    pte, ptd = hostswap.save(hostswap.apply_weight_offload(torch.export.export(model, args)), tmp_path / "in_place")
    pte_c, ptd_c = hostswap.save(hostswap.apply_weight_offload(torch.export.export(model, args), gather_from_host=False), tmp_path / "copied")
    s = hostswap.schedules.load_weight_schedule(pte)
    assert set(s.host_read) == {"embed.weight", "pos.weight"}
    tokens = args[0].cuda()
    with Module(pte_c, ptd_c, weight_offload_budget_mb=1000, device="cuda") as copied:
        want = copied(tokens).clone()
    for graphed in (False, True):
        with Module(pte, ptd, weight_offload_budget_mb=s.floor_bytes / MB, device="cuda", cuda_graph=graphed) as m:
            table = m._host_read["embed.weight"]
            host = m.ptd.host_tensor("embed.weight")
            assert table.device.type == "cuda" and torch.equal(table[:4].cpu(), host[:4])
            assert not any(start <= table.data_ptr() < start + n for start, n in _device_allocations())  # not a device copy
            for _ in range(3):
                assert torch.equal(m(tokens), want)
            assert m.stats["host_read_bytes"] == sum(s.host_read_bytes)


def _device_allocations():
    return [(seg["address"], seg["total_size"]) for seg in torch.cuda.memory_snapshot()]


# the int8 decode kernel against torchao's eager int8 linear: only the fp32 accumulation
# order differs, so at most a step or two of the output dtype's last bit
INT8_KERNEL_TOLERANCE = {torch.bfloat16: 2 * 2**-8, torch.float16: 2 * 2**-11, torch.float32: 1e-6}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_int8_decode_kernel_is_torchaos_linear_and_the_op_takes_it_for_decode_rows(dtype):
    """kernels/int8_weight_only.py against torchao's Int8Tensor linear on CUDA, for one to
    MAX_ROWS rows, with and without bias, at a Llama's shapes and odd ones; the quantized_linear
    op takes the kernel for decode rows (bitwise its result, also inside a CUDA graph) and
    torchao's path for more rows (bitwise torchao's)."""
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    from hostswap.kernels import int8_weight_only
    from hostswap.passes.quantized_linear import QuantizedLinear

    torch.manual_seed(0)
    for n, k, bias in ((2048, 2048, False), (512, 2048, True), (2048, 5632, False), (32000, 2048, False), (100, 300, True)):
        linear = torch.nn.Linear(k, n, bias=bias).to("cuda", dtype)
        quantize_(linear, Int8WeightOnlyConfig(set_inductor_config=False))
        w = linear.weight
        op = QuantizedLinear(linear, "linear")
        for rows in (1, int8_weight_only.MAX_ROWS):
            x = torch.randn(1, rows, k, device="cuda", dtype=dtype)
            with torch.no_grad():
                expected = linear(x)
                ours = int8_weight_only.int8_weight_only_linear(x, w.qdata, w.scale, linear.bias)
                assert ours.shape == expected.shape and ours.dtype == dtype
                diff = (ours.float() - expected.float()).abs().max().item()
                largest = expected.float().abs().max().item()
                assert diff <= INT8_KERNEL_TOLERANCE[dtype] * largest, (n, k, rows, diff, largest)
                assert torch.equal(op(x), ours)
        x = torch.randn(int8_weight_only.MAX_ROWS + 1, k, device="cuda", dtype=dtype)
        with torch.no_grad():
            assert torch.equal(op(x), linear(x))
    # inside a CUDA graph, writing into a given output (the runtime's out variant)
    x = torch.randn(1, k, device="cuda", dtype=dtype)
    out = torch.empty(1, n, device="cuda", dtype=dtype)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        torch.ops.hostswap.quantized_linear.out(x, [getattr(op, name) for name in op.inner_names], op.bias, op.layout, out=out)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        torch.ops.hostswap.quantized_linear.out(x, [getattr(op, name) for name in op.inner_names], op.bias, op.layout, out=out)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    with torch.no_grad():
        assert torch.equal(out, int8_weight_only.int8_weight_only_linear(x, w.qdata, w.scale, linear.bias))
