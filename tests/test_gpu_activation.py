"""Activation offload on a CUDA device: memory really leaves the GPU, gradients stay bitwise."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hostswap

pytestmark = pytest.mark.gpu

H, N_LAYERS, K = 1024, 8, 4


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(H), nn.Linear(H, 4 * H), nn.Linear(4 * H, H)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(Block() for _ in range(N_LAYERS))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _compiled(num_layers, compiler="inductor"):
    torch._dynamo.reset()
    model = Stack().cuda()
    backend = hostswap.activation_offload_backend(model_layers=N_LAYERS, num_layers=num_layers, compiler=compiler)
    return model, torch.compile(model, backend=backend), backend


def _input():
    return torch.randn(8, 1024, H, device="cuda", generator=torch.Generator("cuda").manual_seed(1))


def _measure(num_layers):
    model, step, backend = _compiled(num_layers)
    x = _input()
    step(x).sum().backward()  # compile and warm up (grads allocated)
    for p in model.parameters():
        p.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    loss = step(x).sum()
    torch.cuda.synchronize()
    after_forward = torch.cuda.memory_allocated()
    peak_forward = torch.cuda.max_memory_allocated()
    loss.backward()
    torch.cuda.synchronize()
    grads = [p.grad.clone() for p in model.parameters()]
    return {"start": start, "after_forward": after_forward, "peak_forward": peak_forward, "grads": grads, "backend": backend, "loss": loss.detach()}


def test_offloaded_memory_leaves_the_gpu_and_gradients_stay_bitwise():
    base = _measure(0)
    off = _measure(K)
    saved_no_offload = base["after_forward"] - base["start"]
    saved_offload = off["after_forward"] - off["start"]
    offloaded = off["backend"].synchronizer.bytes_offloaded
    theory = sum(r["offloaded_bytes"] for r in off["backend"].schedule.rows())
    print(f"\nno offload: {saved_no_offload / 2**20:.1f} MiB of activations after forward; offload {K} of {N_LAYERS}: "
          f"{saved_offload / 2**20:.1f} MiB; offloaded {offloaded / 2**20:.1f} MiB (pass says {theory / 2**20:.1f}); "
          f"peak in forward {(base['peak_forward'] - base['start']) / 2**20:.1f} -> {(off['peak_forward'] - off['start']) / 2**20:.1f} MiB; "
          f"max offloaded layers on the GPU at once {off['backend'].synchronizer.max_offloaded_layers_on_gpu}")
    assert offloaded == theory > 0
    # memory after forward = start + the activations that were not offloaded (within 10 %)
    assert abs(saved_offload - (saved_no_offload - offloaded)) <= 0.10 * (saved_no_offload - offloaded)
    # host bytes plus what stayed on the GPU account for the no-offload memory
    assert abs((offloaded + saved_offload) - saved_no_offload) <= 0.10 * saved_no_offload
    # at most n-k layers' activations on the GPU during forward (plus one layer's transients)
    per_layer = saved_no_offload / N_LAYERS
    assert off["peak_forward"] - off["start"] <= (N_LAYERS - K + 1) * per_layer * 1.10
    assert off["backend"].synchronizer.max_offloaded_layers_on_gpu <= N_LAYERS - K
    again = _measure(0)
    worst = max((a - b).abs().max().item() for a, b in zip(base["grads"], off["grads"]))
    print(f"max |grad diff| offload vs none {worst:.3e}; no-offload run to run bitwise: {all(torch.equal(a, b) for a, b in zip(base['grads'], again['grads']))}")
    assert torch.equal(base["loss"], off["loss"])
    assert all(torch.equal(a, b) for a, b in zip(base["grads"], off["grads"]))


def test_offload_copies_run_on_their_own_stream():
    model, step, backend = _compiled(K)
    x = _input()
    step(x).sum().backward()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step(x).sum().backward()
        torch.cuda.synchronize()
    copies = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and ("DtoH" in e.name or "HtoD" in e.name)]
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and "Memcpy" not in e.name and "Memset" not in e.name]
    copy_streams = {getattr(e, "device_resource_id", None) for e in copies}
    kernel_streams = {getattr(e, "device_resource_id", None) for e in kernels}
    print(f"\n{len(copies)} copies on streams {copy_streams}, kernels on {kernel_streams}")
    assert copies and copy_streams.isdisjoint(kernel_streams)


def test_step_captured_in_a_cuda_graph_replays_correctly():
    model, step, backend = _compiled(K, compiler="eager")
    reference_model = copy.deepcopy(model)
    static_x = _input()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step(static_x).sum().backward()
    torch.cuda.current_stream().wait_stream(side)
    for p in model.parameters():
        p.grad.zero_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss = step(static_x).sum()
        static_loss.backward()
    new_x = _input() * 0.5 + 0.25
    static_x.copy_(new_x)
    for p in model.parameters():
        p.grad.zero_()
    graph.replay()
    torch.cuda.synchronize()
    reference_model(new_x).sum().backward()
    worst = max((p.grad - r.grad).abs().max().item() for p, r in zip(model.parameters(), reference_model.parameters()))
    print(f"\nCUDA-graph replay with new input: max |grad diff| vs eager {worst:.3e}")
    for p, r in zip(model.parameters(), reference_model.parameters()):
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-4, atol=1e-4)


def _traced_peak(**kw):
    torch._dynamo.reset()
    model = Stack().cuda()
    backend = hostswap.activation_offload_backend(model_layers=N_LAYERS, **kw)
    step = torch.compile(model, backend=backend)
    x = _input()
    step(x).sum().backward()
    for p in model.parameters():
        p.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    backend.synchronizer.memory_trace = []
    step(x).sum().backward()
    torch.cuda.synchronize()
    trace = backend.synchronizer.memory_trace
    backend.synchronizer.memory_trace = None
    # the trace resets the peak counter at every boundary: the step's peak is the largest of
    # the per-segment peaks and the last segment's
    return trace, max([high for _, _, high in trace] + [torch.cuda.max_memory_allocated()]) - base


def test_memory_trace_and_reload_ahead_lower_the_step_peak():
    """The trace has one entry per layer boundary; reloading one layer later than the default
    (reload_ahead = n-k-2) leaves room for the weight gradients made meanwhile, so the step's
    peak is no higher than with the default schedule, and both are below no offload."""
    none_trace, none_peak = _traced_peak(num_layers=0)
    default_trace, default_peak = _traced_peak(num_layers=K)
    later_trace, later_peak = _traced_peak(num_layers=K, reload_ahead=N_LAYERS - K - 2)
    names = [t[0] for t in default_trace]
    assert names == [f"fwd {i}" for i in range(N_LAYERS)] + [f"bwd {i}" for i in reversed(range(N_LAYERS))]
    assert len(none_trace) == len(later_trace) == 2 * N_LAYERS
    print(f"\nstep peak: no offload {none_peak / 2**20:.1f} MiB, default {default_peak / 2**20:.1f} MiB, reload_ahead={N_LAYERS - K - 2} {later_peak / 2**20:.1f} MiB")
    assert later_peak <= default_peak < none_peak
