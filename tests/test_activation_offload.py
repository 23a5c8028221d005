"""Activation offload pass: same loss and gradients bit for bit, schedule, validation, graph order."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hostswap
from hostswap.passes.activation_offload import ACT_BOUNDARY, ACT_OFFLOAD, ACT_RELOAD, ActivationOffloadError
from hostswap.runtime.activation_offload import OffloadSynchronizer
from hostswap.schedules.sync_dict import ActivationSchedule, NoOverlapWarning, SyncDictError, default_sync_dict, fitted_sync_dict, point, validate_sync_dict

H = 32


class MLPBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(H), nn.Linear(H, 4 * H), nn.Linear(4 * H, H)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class AttentionBlock(nn.Module):
    def __init__(self, heads=4):
        super().__init__()
        self.heads = heads
        self.norm, self.qkv, self.out = nn.LayerNorm(H), nn.Linear(H, 3 * H), nn.Linear(H, H)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, s, 3, self.heads, H // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.out(a.transpose(1, 2).reshape(b, s, H))


class ViewsAndDuplicatesBlock(nn.Module):
    """Saves views of one base (slices of a projection) and one tensor twice (x * x)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(H, 2 * H)

    def forward(self, x):
        y = self.proj(x)
        left, right = y[..., :H], y[..., H:]
        return x + left * right + left * left


class MarkedBlock(MLPBlock):
    def forward(self, x):
        h = hostswap.mark_not_offload(self.up(self.norm(x)))
        return x + self.down(F.gelu(h))


class Stack(nn.Module):
    def __init__(self, block, n=4):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(block() for _ in range(n))
        self.head = nn.Linear(H, 8)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _steps(model, backend, x, steps=2):
    model = copy.deepcopy(model)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend)
    results = []
    for _ in range(steps):
        loss = compiled(x).float().pow(2).sum()
        loss.backward()
        results.append((loss.detach().clone(), [p.grad.clone() for p in model.parameters()]))
        for p in model.parameters():
            p.grad = None
    return results


def _assert_bitwise(a, b):
    for (loss_a, grads_a), (loss_b, grads_b) in zip(a, b):
        assert torch.equal(loss_a, loss_b)
        assert all(torch.equal(ga, gb) for ga, gb in zip(grads_a, grads_b))


@pytest.mark.parametrize("block,compiler", [(MLPBlock, "eager"), (MLPBlock, "inductor"), (AttentionBlock, "eager"), (AttentionBlock, "inductor"), (ViewsAndDuplicatesBlock, "eager"), (ViewsAndDuplicatesBlock, "inductor")])
def test_offloaded_gradients_bitwise_equal_no_offload(block, compiler):
    model = Stack(block)
    x = torch.randn(2, 16, H, generator=torch.Generator().manual_seed(1))
    reference = _steps(model, hostswap.activation_offload_backend(model_layers=4, num_layers=0, compiler=compiler, min_tensor_size_to_offload=0), x)
    backend = hostswap.activation_offload_backend(model_layers=4, num_layers=2, compiler=compiler, min_tensor_size_to_offload=0)
    _assert_bitwise(reference, _steps(model, backend, x))
    sync = backend.synchronizer
    assert sync.bytes_offloaded == sum(r["offloaded_bytes"] for r in backend.schedule.rows()) > 0
    log = [a for a in sync.log if not a[0].startswith("offload")]
    assert [a for a in log if a[0] == "release"] == [("release", 0), ("release", 1)]
    assert [a for a in log if a[0] == "reload"] == [("reload", 1), ("reload", 0)]
    for layer in (0, 1):  # released before its reload starts, reloaded before consumed
        assert log.index(("release", layer)) < log.index(("reload", layer)) < log.index(("reloaded", layer))
    assert sync.max_offloaded_layers_on_gpu <= 2
    assert sync.pinned_allocations == len(sync.tensors)  # host buffers reused by the second step


def test_views_offloaded_once_as_their_base_and_duplicates_once():
    # min-cut recomputes views itself, so the folding is checked on a forward graph that saves
    # two slices of one base and the base twice (as the default partitioner can)
    from torch.fx.experimental.proxy_tensor import make_fx

    from hostswap.passes.activation_offload import LayerMap, saved_groups

    def forward(x, w):
        y = x @ w
        return torch.relu(y).sum(), y[:, :4], y[:, 4:], y, y

    gm = make_fx(forward, tracing_mode="fake")(torch.randn(4, 8), torch.randn(8, 8))
    for node in gm.graph.nodes:
        if node.op == "call_function":
            node.meta["nn_module_stack"] = {"layer": ("L['self'].layers.0", nn.Module)}
    groups, kept = saved_groups(gm, 1, LayerMap(gm.graph, None), 0)
    assert len(groups) == 1 and groups[0].base.target is torch.ops.aten.mm.default
    assert len(groups[0].saved) == 3  # two slices and the base, the duplicate folded
    assert groups[0].nbytes == 4 * 8 * 4 and kept == {}


def test_attention_saves_rebuilt_views_bitwise():
    # SDPA saves q/k/v, its output and logsumexp; q/k/v are views of the qkv projection
    model = Stack(AttentionBlock)
    x = torch.randn(2, 16, H)
    backend = hostswap.activation_offload_backend(model_layers=4, num_layers=2, compiler="eager", min_tensor_size_to_offload=0)
    reference = _steps(model, hostswap.activation_offload_backend(model_layers=4, num_layers=0, compiler="eager"), x, steps=1)
    _assert_bitwise(reference, _steps(model, backend, x, steps=1))


def test_rewritten_graphs_have_the_nodes_in_order():
    model = Stack(MLPBlock)
    backend = hostswap.activation_offload_backend(model_layers=4, num_layers=2, compiler="eager", min_tensor_size_to_offload=0)
    _steps(model, backend, torch.randn(2, 16, H), steps=1)
    fw = list(backend.forward_graph.graph.nodes)
    offloads = [n for n in fw if n.target is ACT_OFFLOAD]
    for n in offloads:  # each offload directly follows the tensor it copies
        assert fw.index(n) == fw.index(n.args[0]) + 1 or fw[fw.index(n) - 1].target is ACT_OFFLOAD
    assert [n.args[2] for n in fw if n.target is ACT_BOUNDARY] == [0, 1, 2, 3]  # one per layer; releases at fwd 2, 3
    # each released tensor is an argument of its release boundary: compilers keep it alive until then
    keep = {n.args[2]: {k.name for k in n.args[3]} for n in fw if n.target is ACT_BOUNDARY}
    assert keep[2] == {g.base.name for g in backend.groups if g.layer == 0} and keep[3] == {g.base.name for g in backend.groups if g.layer == 1}
    assert keep[0] == keep[1] == set()
    from hostswap.passes.activation_offload import offloads_kept_alive

    assert all(offloads_kept_alive(backend.forward_graph.graph))
    assert {g.layer for g in backend.groups} == {0, 1}
    bw = list(backend.backward_graph.graph.nodes)
    # bwd 3 is point 4 ... bwd 0 point 7; the reload of layer 1 starts at bwd 2 (point 5)
    assert [n.args[2] for n in bw if n.target is ACT_BOUNDARY] == [4, 5, 6, 7]
    assert backend.schedule.actions_at(5) == ([], [1]) and backend.schedule.actions_at(2) == ([0], [])
    for n in bw:
        if n.target is ACT_RELOAD:
            assert min(bw.index(u) for u in n.users) > bw.index(n)
    # the forward no longer returns offloaded tensors, only empty placeholders for them
    outputs = backend.forward_graph.graph.output_node().args[0]
    assert all(o.target is ACT_OFFLOAD for o in outputs if getattr(o, "target", None) is ACT_OFFLOAD)
    assert not any(o in [g.base for g in backend.groups] for o in outputs)


def _compute_targets(gm):
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function" and n.target not in (ACT_OFFLOAD, ACT_RELOAD, torch.ops.aten.as_strided.default)]


def test_num_layers_zero_compiles_the_same_graphs_without_offload():
    x = torch.randn(2, 16, H)
    zero = hostswap.activation_offload_backend(model_layers=4, num_layers=0, compiler="eager")
    _steps(Stack(MLPBlock), zero, x, steps=1)
    assert not any(n.target in (ACT_OFFLOAD, ACT_RELOAD) for g in (zero.forward_graph, zero.backward_graph) for n in g.graph.nodes)
    assert [n.args[2] for n in zero.forward_graph.graph.nodes if n.target is ACT_BOUNDARY] == [0, 1, 2, 3]
    two = hostswap.activation_offload_backend(model_layers=4, num_layers=2, compiler="eager", min_tensor_size_to_offload=0)
    _steps(Stack(MLPBlock), two, x, steps=1)
    for a, b in ((zero.forward_graph, two.forward_graph), (zero.backward_graph, two.backward_graph)):
        assert _compute_targets(a) == _compute_targets(b)  # they differ only in offload and reload


def test_small_tensors_and_marked_tensors_stay():
    model = Stack(MarkedBlock)
    backend = hostswap.activation_offload_backend(model_layers=4, num_layers=2, compiler="eager", min_tensor_size_to_offload=0)
    reference = _steps(model, hostswap.activation_offload_backend(model_layers=4, num_layers=0, compiler="eager"), torch.ones(2, 16, H))
    _assert_bitwise(reference, _steps(model, backend, torch.ones(2, 16, H)))
    marked = [n for n in backend.forward_graph.graph.nodes if n.target is torch.ops.hostswap.not_offload.default]
    assert marked and not any(m in [g.base for g in backend.groups] for m in marked)
    assert backend.schedule.rows()[0]["kept_bytes"] > 0
    big = hostswap.activation_offload_backend(model_layers=4, num_layers=2, compiler="eager", min_tensor_size_to_offload=1 << 30)
    _steps(Stack(MLPBlock), big, torch.randn(2, 16, H), steps=1)
    assert big.groups == [] and big.synchronizer.bytes_offloaded == 0


def test_manual_mode_follows_the_calls():
    model = Stack(MLPBlock)
    x = torch.randn(2, 16, H)
    reference = _steps(model, hostswap.activation_offload_backend(model_layers=4, num_layers=0, compiler="eager"), x, steps=1)
    backend = hostswap.activation_offload_backend(model_layers=4, manual=True, compiler="eager", min_tensor_size_to_offload=0)
    torch._dynamo.reset()
    m = copy.deepcopy(model)
    loss = torch.compile(m, backend=backend)(x).float().pow(2).sum()
    assert backend.synchronizer.bytes_offloaded == 0  # nothing moves until asked
    backend.start_offload_layer(1)
    backend.release_activation_forward_gpu_memory(1)
    backend.start_reload_layer(1)
    loss.backward()
    assert [a for a in backend.synchronizer.log if not a[0].startswith("offload")][:2] == [("release", 1), ("reload", 1)]
    _assert_bitwise(reference, [(loss.detach(), [p.grad for p in m.parameters()])])


def test_non_dense_tensor_is_made_contiguous_and_restored():
    schedule = ActivationSchedule(2, {0: (True, 1, False, 0)})
    sync = OffloadSynchronizer(schedule)
    sync.register(0, 0)
    x = torch.arange(64.0).view(8, 8)[:, ::2]  # gaps: not dense
    placeholder = sync.push(0, x)
    assert placeholder.numel() == 0 and sync.tensors[0].host.is_contiguous()
    sync.release_activation_forward_gpu_memory(0)
    y = sync.pop(0)
    assert torch.equal(y, x) and y.stride() == x.stride()
    sync.close()


def test_default_dictionary_and_its_limits():
    assert default_sync_dict(5, 2) == {0: (True, 3, False, 2), 1: (True, 4, False, 3)}
    assert default_sync_dict(5, 0) == {}
    with pytest.raises(SyncDictError, match="num_layers=5 with model_layers=5"):
        default_sync_dict(5, 5)
    with pytest.warns(NoOverlapWarning, match="cannot overlap"):
        default_sync_dict(5, 4)
    with pytest.raises(SyncDictError, match="num_layers must be an int"):
        default_sync_dict(5, -1)
    with pytest.raises(SyncDictError, match="model_layers must be a positive int"):
        default_sync_dict(0, 0)
    # reload_ahead: the reload of layer i starts at layer i+r's backward (capped at the last layer)
    assert default_sync_dict(5, 2, reload_ahead=1) == {0: (True, 3, False, 1), 1: (True, 4, False, 2)}
    assert default_sync_dict(5, 2, reload_ahead=9) == {0: (True, 3, False, 4), 1: (True, 4, False, 4)}
    for bad in (0, True, 1.5):
        with pytest.raises(SyncDictError, match="reload_ahead must be an int >= 1"):
            default_sync_dict(5, 2, reload_ahead=bad)


def _reload_lateness(sync, n, backward_s, reload_s):
    """Simulate the backward: reloads one after another on one copy stream, each starting when
    the backward reaches its point; seconds each lands after its layer's backward begins."""
    begins = {n - 1: 0.0}
    for j in range(n - 2, -1, -1):
        begins[j] = begins[j + 1] + backward_s[j + 1]
    free, late = -float("inf"), {}
    for i in sorted(sync, reverse=True):  # the copy stream takes them in the order they are needed
        p = point(sync[i][2], sync[i][3], n)
        at = begins[2 * n - 1 - p] if p >= n else -float("inf")
        free = max(free, at) + reload_s[i]
        late[i] = free - begins[i]
    return late


def test_fitted_reloads_start_as_late_as_still_hides_them():
    n, k = 8, 3
    backward = {j: 1.0 for j in range(n)}
    base = default_sync_dict(n, k, reload_ahead=1)
    # reloads faster than a layer's backward: one layer ahead hides them (the leanest schedule)
    assert fitted_sync_dict(base, n, backward, {i: 0.5 for i in range(k)}, margin=1.0) == base
    # 2 layers' backward per reload: the stream is busy from bwd 6 to bwd 0, each landing just in time
    fitted = fitted_sync_dict(base, n, backward, {i: 2.0 for i in range(k)}, margin=1.0)
    assert {i: e[3] for i, e in fitted.items()} == {0: 2, 1: 4, 2: 6}
    assert all(e[2] is False and e[:2] == base[i][:2] for i, e in fitted.items())
    assert max(_reload_lateness(fitted, n, backward, {i: 2.0 for i in range(k)}).values()) <= 0
    # 2.5: layer 2 cannot be hidden, and starts at its earliest point, the n-k bound (bwd 6),
    # not at the backward's start, where n-k layers' activations are still on the GPU
    fitted = fitted_sync_dict(base, n, backward, {i: 2.5 for i in range(k)}, margin=1.0)
    assert {i: e[3] for i, e in fitted.items()} == {0: 3, 1: 5, 2: 6}
    with pytest.raises(SyncDictError, match="layer 5 has none"):
        fitted_sync_dict(base, n, {j: 1.0 for j in range(n) if j != 5}, {i: 0.5 for i in range(k)})


def test_fitted_reloads_keep_within_the_headroom_the_step_leaves():
    """Memory first: a reload that would hold more than a point's headroom moves later, down to
    one layer ahead (the leanest), even if its copy is then no longer hidden."""
    n, k = 8, 3
    backward, reload = {j: 1.0 for j in range(n)}, {i: 2.0 for i in range(k)}
    base = default_sync_dict(n, k, reload_ahead=1)
    nbytes = {i: 100 for i in range(k)}
    starts = lambda sync: {i: e[3] for i, e in sync.items()}  # noqa: E731
    assert starts(fitted_sync_dict(base, n, backward, reload, margin=1.0, reload_bytes=nbytes, headroom={})) == {0: 2, 1: 4, 2: 6}
    # layer 5's backward start has room for half a layer: layer 2 starts at 5; layer 3's for one
    # and a half: layer 1 (under way beside layer 2 there) starts at 3
    fitted = fitted_sync_dict(base, n, backward, reload, margin=1.0, reload_bytes=nbytes, headroom={5: 50, 3: 150})
    assert starts(fitted) == {0: 2, 1: 3, 2: 5}
    # no room anywhere: the leanest schedule
    assert fitted_sync_dict(base, n, backward, reload, margin=1.0, reload_bytes=nbytes, headroom={j: 0 for j in range(n)}) == base
    with pytest.raises(SyncDictError, match="reload bytes; layer 0 has none"):
        fitted_sync_dict(base, n, backward, reload, headroom={})


@pytest.mark.parametrize("random_state", range(20))
def test_fitted_reloads_are_on_time_and_latest(random_state):
    """On random layer and copy times: where the earliest allowed points could land every reload
    in time, the fitted ones do too; and no reload could start one point later without one
    landing late (or it is at its own backward already)."""
    g = torch.Generator().manual_seed(random_state)
    n = int(torch.randint(4, 12, (1,), generator=g))
    k = int(torch.randint(1, n - 1, (1,), generator=g))
    backward = {j: float(torch.rand(1, generator=g)) + 0.1 for j in range(n)}
    reload = {i: float(torch.rand(1, generator=g)) * 3 for i in range(k)}
    earliest = default_sync_dict(n, k)
    fitted = fitted_sync_dict(default_sync_dict(n, k, reload_ahead=1), n, backward, reload, margin=1.0)
    validate_sync_dict(fitted, n)
    if all(v <= 1e-9 for v in _reload_lateness(earliest, n, backward, reload).values()):
        assert all(v <= 1e-9 for v in _reload_lateness(fitted, n, backward, reload).values())
    for i, e in fitted.items():
        if e[3] == i or point(e[2], e[3], n) == point(earliest[i][2], earliest[i][3], n) and max(_reload_lateness(fitted, n, backward, reload).values()) > 1e-9:
            continue
        later = dict(fitted)
        later[i] = (e[0], e[1], False, e[3] - 1)
        assert max(_reload_lateness(later, n, backward, reload).values()) > 1e-9, (i, fitted)


def test_reload_ahead_reloads_late_and_stays_bitwise():
    model = Stack(MLPBlock)
    x = torch.randn(2, 16, H, generator=torch.Generator().manual_seed(1))
    reference = _steps(model, hostswap.activation_offload_backend(model_layers=4, num_layers=0, min_tensor_size_to_offload=0), x)
    backend = hostswap.activation_offload_backend(model_layers=4, num_layers=2, reload_ahead=1, min_tensor_size_to_offload=0)
    _assert_bitwise(reference, _steps(model, backend, x))
    log = [a for a in backend.synchronizer.log if not a[0].startswith("offload")]
    # layer 1 is reloaded only after layer 3's backward (the last non-offloaded one) is done with
    assert [a for a in log if a[0] == "reload"] == [("reload", 1), ("reload", 0)]
    assert backend.schedule.rows()[1]["reload_start"] == "bwd 2" and backend.schedule.rows()[0]["reload_start"] == "bwd 1"


@pytest.mark.parametrize("block", [MLPBlock, AttentionBlock])
def test_reload_copies_in_the_order_the_backward_reads(block, monkeypatch):
    # The forward saves a layer's tensors in roughly the reverse of the order its backward
    # reads them; reloading in the backward's order lets that backward start on the first
    # tensor to land instead of the last.
    model = Stack(block)
    x = torch.randn(2, 16, H, generator=torch.Generator().manual_seed(1))
    reference = _steps(model, hostswap.activation_offload_backend(model_layers=4, num_layers=0, min_tensor_size_to_offload=0), x)
    backend = hostswap.activation_offload_backend(model_layers=4, num_layers=2, min_tensor_size_to_offload=0)
    sync = backend.synchronizer
    popped = []
    original = OffloadSynchronizer.pop

    def pop(self, tensor, *args):
        popped.append(tensor)
        return original(self, tensor, *args)

    monkeypatch.setattr(OffloadSynchronizer, "pop", pop)
    _assert_bitwise(reference, _steps(model, backend, x))
    last_step = popped[len(popped) // 2:]
    assert sorted(last_step) == sorted(sync.tensors) and len(last_step) > 2
    for layer in (0, 1):
        reloaded = [t for t in sync.reloads if sync.tensors[t].layer == layer]
        read = [t for t in last_step if sync.tensors[t].layer == layer]
        assert len(reloaded) > 1 and reloaded == read, (layer, reloaded, read)
        # the forward's order (registration) is not the backward's
        registered = sorted(read)
        assert read != registered, (layer, read)


def test_reload_order_moves_only_the_tensors_it_names():
    # With a graph break a layer's tensors can come from two compiled graphs; one backward's
    # order must not push the other graph's tensors around.
    sync = OffloadSynchronizer(ActivationSchedule(2, validate_sync_dict({0: (True, 1, False, 1)}, 2)))
    for t in range(5):
        sync.register(t, 0)
    sync.set_reload_order([3, 1])
    assert sync.layer_tensors[0] == [0, 3, 2, 1, 4]
    sync.set_reload_order([4, 0, 2])
    assert sync.layer_tensors[0] == [4, 3, 0, 1, 2]
    sync.close()


@pytest.mark.parametrize("sync,message", [
    ({1: (False, 0, False, 0)}, "layer 1: reload would start at bwd 0, after layer 1's backward begins"),
    ({1: (True, 1, False, 1)}, "layer 1: offload would finish at fwd 1, before layer 1's forward ends"),
    ({1: (False, 1, False, 3)}, r"layer 1: reload would start at bwd 3, before its offload finishes at bwd 1"),
    ({7: (True, 2, False, 1)}, "key 7 is not a layer index in 0..4"),
    ({0: (True, 2, False)}, "layer 0: entry"),
    ({0: (1, 2, False, 1)}, "layer 0: offload_fwd must be a bool"),
    ({0: (True, 9, False, 1)}, "layer 0: offload_num must be a layer index"),
])
def test_dictionary_errors_name_the_layer(sync, message):
    with pytest.raises(SyncDictError, match=message):
        validate_sync_dict(sync, 5)


def test_custom_dictionary_runs_and_is_tabulated(tmp_path):
    sync = {0: (True, 2, False, 1), 2: (False, 3, False, 2)}
    model = Stack(MLPBlock)
    x = torch.randn(2, 16, H)
    reference = _steps(model, hostswap.activation_offload_backend(model_layers=4, num_layers=0, compiler="eager"), x, steps=1)
    backend = hostswap.activation_offload_backend(model_layers=4, synchronization_dict=sync, compiler="eager", min_tensor_size_to_offload=0)
    _assert_bitwise(reference, _steps(model, backend, x, steps=1))
    table = backend.schedule.table()
    assert "bwd 3" in table and "2 of 4 layers offloaded" in table
    backend.schedule.plot(str(tmp_path / "schedule.svg"))
    assert (tmp_path / "schedule.svg").stat().st_size > 0


def test_backend_errors():
    with pytest.raises(ActivationOffloadError, match="exactly one of"):
        hostswap.activation_offload_backend(model_layers=4, num_layers=1, synchronization_dict={})
    with pytest.raises(ActivationOffloadError, match="compiler must be one of"):
        hostswap.activation_offload_backend(model_layers=4, num_layers=1, compiler="tvm")
    with pytest.raises(ActivationOffloadError, match="min_tensor_size_to_offload"):
        hostswap.activation_offload_backend(model_layers=4, num_layers=1, min_tensor_size_to_offload=-1)
    with pytest.raises(ActivationOffloadError, match="reload_ahead= applies to the default schedule"):
        hostswap.activation_offload_backend(model_layers=4, synchronization_dict={}, reload_ahead=1)
    with pytest.raises(SyncDictError, match="reload_ahead must be an int >= 1"):
        hostswap.activation_offload_backend(model_layers=4, num_layers=1, reload_ahead=0)
    with pytest.raises(ActivationOffloadError, match="reload_ahead='auto' is OffloadContext's"):
        hostswap.activation_offload_backend(model_layers=4, num_layers=1, reload_ahead="auto")
    backend = hostswap.activation_offload_backend(model_layers=6, num_layers=1, compiler="eager")
    with pytest.raises(Exception, match="model_layers=6, but the compiled model has 4 blocks"):
        _steps(Stack(MLPBlock), backend, torch.randn(2, 16, H), steps=1)
    named = hostswap.activation_offload_backend(model_layers=4, num_layers=1, compiler="eager", layers="blocks")
    with pytest.raises(Exception, match="layers='blocks' names no repeated block list"):
        _steps(Stack(MLPBlock), named, torch.randn(2, 16, H), steps=1)


def test_reload_returns_the_layout_the_graph_declared():
    # a compiler may lay a buffer out otherwise than the graph's metadata says (seen with
    # Inductor on an H100); the compiled backward expects the declared strides
    schedule = ActivationSchedule(2, {0: (True, 1, False, 0)})
    sync = OffloadSynchronizer(schedule)
    sync.register(0, 0)
    x = torch.arange(24.0).view(2, 3, 4)
    sync.push(0, x)
    declared = torch.empty(2, 3, 4).transpose(0, 2).contiguous().transpose(0, 2).stride()
    y = sync.pop(0, (2, 3, 4), declared)
    assert y.stride() == declared and torch.equal(y, x)
    sync.close()


def test_manual_calls_on_a_layer_not_saved_this_step_do_nothing():
    sync = OffloadSynchronizer(ActivationSchedule(3, {0: (True, 1, False, 0)}, manual=True))
    sync.register(0, 0)
    sync.start_offload_layer(0)
    sync.release_activation_forward_gpu_memory(0)
    sync.start_reload_layer(0)
    assert sync.log == [] and sync.bytes_offloaded == 0
    sync.close()
