"""The eager front end of activation offload (OffloadContext): saved activations of the
offloaded layers go to host buffers and come back for the backward; gradients are bitwise
those of the same model without offload, on transformers decoder layers."""

from __future__ import annotations

import pytest
import torch

import hostswap.activations as activations
from hostswap.schedules.sync_dict import SyncDictError, default_sync_dict, fitted_sync_dict, point


def _llama(layers=4):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=layers, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=256)
    return LlamaForCausalLM(config).train()


def _step(model, ids, offload=None):
    """A training step that runs the decoder layers one by one, as the eager API is used."""
    inner = model.model
    h = inner.embed_tokens(ids)
    positions = torch.arange(ids.shape[1]).unsqueeze(0)
    rotary = inner.rotary_emb(h, positions)
    mask = torch.full((ids.shape[1], ids.shape[1]), float("-inf")).triu(1)[None, None]
    for i, layer in enumerate(inner.layers):
        with offload.layer(i) if offload is not None else torch.enable_grad():
            h = layer(h, attention_mask=mask, position_embeddings=rotary, position_ids=positions)
            h = h[0] if isinstance(h, tuple) else h
    loss = model.lm_head(inner.norm(h)).float().logsumexp(-1).mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("num_layers", [1, 2])
def test_gradients_are_bitwise_those_without_offload(num_layers):
    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(1))
    plain = _llama()
    expected_loss, expected = _step(plain, ids)
    model = _llama()
    offload = activations.OffloadContext(model_layers=4, num_layers=num_layers, min_offload_bytes=1024)
    for step in range(2):  # the second step reuses the pinned buffers of the first
        model.zero_grad()
        loss, grads = _step(model, ids, offload)
        assert torch.equal(loss, expected_loss)
        for name, g in expected.items():
            assert torch.equal(grads[name], g), name
        stats = offload.stats
        assert stats["bytes_offloaded"] > 0
        actions = {a for a, _ in stats["log"]}
        assert {"offload", "release", "reload"} <= actions, stats["log"]
        if step == 0:
            allocations = stats["pinned_allocations"]
    assert offload.stats["pinned_allocations"] == allocations
    assert offload.stats["max_offloaded_layers_on_gpu"] <= 4 - num_layers


def test_a_layers_copies_to_host_are_queued_together_when_its_forward_ends():
    """One group of copies per offloaded layer and step, queued after every tensor of that
    layer was saved and before the next layer's first: the host work per tensor is the copy
    call alone."""
    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(1))
    model = _llama()
    offload = activations.OffloadContext(model_layers=4, num_layers=2, min_offload_bytes=1024)
    _step(model, ids, offload)
    log = offload.stats["log"]
    groups = [entry for entry in log if entry[0] == "offload copies"]
    assert groups == [("offload copies", 0), ("offload copies", 1)]
    for layer in (0, 1):
        saves = [k for k, entry in enumerate(log) if entry == ("offload", layer)]
        assert saves and max(saves) < log.index(("offload copies", layer)) < log.index(("release", layer))
    assert log.index(("offload copies", 0)) < log.index(("offload", 1))  # queued at layer 0's end, not later
    assert offload.stats["bytes_offloaded"] == sum(t.host.numel() * t.host.element_size() for t in offload.synchronizer.tensors.values())


def test_arguments_are_checked():
    with pytest.raises(SyncDictError, match="give num_layers .* or synchronization_dict, not both"):
        activations.OffloadContext(model_layers=4)
    with pytest.raises(SyncDictError, match="num_layers=4 with model_layers=4"):
        activations.OffloadContext(model_layers=4, num_layers=4)
    offload = activations.OffloadContext(model_layers=4, num_layers=1)
    with pytest.raises(SyncDictError, match="layer index must be an int in 0..3, got 4"):
        with offload.layer(4):
            pass


def test_module_choice_offloads_only_what_those_submodules_save():
    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(1))
    _, expected = _step(_llama(), ids)
    totals = {}
    for modules in (None, ("mlp",), ("self_attn",), ("mlp.down_proj", "self_attn.o_proj")):
        model = _llama()
        offload = activations.OffloadContext(model_layers=4, num_layers=2, min_offload_bytes=1024, modules=modules)
        inner = model.model
        # the layer module is given so that submodule names resolve
        original = OffloadContextLayers(offload, inner.layers)
        _, grads = _step(model, ids, original)
        for name, g in expected.items():
            assert torch.equal(grads[name], g), (modules, name)
        stats = offload.stats
        totals[modules] = stats["bytes_offloaded"]
        assert stats["transfer_seconds"] > 0
        if modules is not None:
            assert set(stats["bytes_by_module"]) <= set(modules) and sum(stats["bytes_by_module"].values()) == stats["bytes_offloaded"]
            assert set(stats["transfer_seconds_by_module"]) == set(stats["bytes_by_module"])
            assert abs(sum(stats["transfer_seconds_by_module"].values()) - stats["transfer_seconds"]) < 1e-9
    assert 0 < totals[("mlp",)] < totals[None] and 0 < totals[("self_attn",)] < totals[None]
    assert totals[("mlp.down_proj", "self_attn.o_proj")] < totals[("mlp",)] + totals[("self_attn",)]
    with pytest.raises(ValueError, match=r"give the layer, offload.layer\(i, module=layer\)"):
        with activations.OffloadContext(model_layers=4, num_layers=1, modules=("mlp",)).layer(0):
            pass
    with pytest.raises(ValueError, match="modules must be a tuple of submodule name patterns"):
        activations.OffloadContext(model_layers=4, num_layers=1, modules="mlp")


class OffloadContextLayers:
    """``offload.layer(i)`` with the layer module passed along, for _step."""

    def __init__(self, offload, layers):
        self.offload, self.layers = offload, layers

    def layer(self, i):
        return self.offload.layer(i, module=self.layers[i])


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_with_gradient_checkpointing_the_residual_stream_is_what_goes(use_reentrant):
    """transformers' gradient_checkpointing_enable(): a checkpointed layer saves only its input,
    the residual stream; under OffloadContext that input goes to the host (Surogate's
    offload_residual with recompute), and gradients stay bitwise."""
    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(1))
    plain = _llama()
    plain.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
    _, expected = _step(plain, ids)
    model = _llama()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
    offload = activations.OffloadContext(model_layers=4, num_layers=2, min_offload_bytes=1024)
    _, grads = _step(model, ids, offload)
    for name, g in expected.items():
        assert torch.equal(grads[name], g), name
    residual = 2 * 64 * 128 * 4  # one [2, 64, 128] fp32 hidden state per offloaded layer
    assert offload.stats["bytes_offloaded"] == 2 * residual, offload.stats


def test_composes_with_torch_compile():
    """Layers compiled with torch.compile (AOTAutograd) under OffloadContext: the saved
    tensors of the compiled graphs go through the same hooks; gradients stay bitwise."""
    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(1))
    _, expected = _step(_llama(), ids)
    model = _llama()
    for layer in model.model.layers:
        layer.forward = torch.compile(layer.forward, backend="aot_eager")
    offload = activations.OffloadContext(model_layers=4, num_layers=2, min_offload_bytes=1024)
    _, grads = _step(model, ids, offload)
    for name, g in expected.items():
        assert torch.equal(grads[name], g), name
    assert offload.stats["bytes_offloaded"] > 0
    assert {"offload", "release", "reload"} <= {a for a, _ in offload.stats["log"]}


def _model_step(model, ids):
    """A step through the model's own forward (transformers' loop over its layers)."""
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("checkpointing", [False, True])
def test_attach_offloads_under_the_models_own_forward(checkpointing):
    """attach(model.model.layers): the transformers model's own forward offloads the same
    bytes as the explicit loop, gradients stay bitwise, and detach() restores the layers."""
    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(1))
    plain = _llama()
    model = _llama()
    if checkpointing:
        for m in (plain, model):
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    expected_loss, expected = _model_step(plain, ids)
    offload = activations.OffloadContext(model_layers=4, num_layers=2, min_offload_bytes=1024, modules=None if checkpointing else ("mlp",))
    layer_class = type(model.model.layers[0])
    offload.attach(model.model.layers)
    assert isinstance(model.model.layers[0], layer_class) and set(model.state_dict()) == set(plain.state_dict())
    for _ in range(2):
        model.zero_grad()
        loss, grads = _model_step(model, ids)
        assert torch.equal(loss, expected_loss)
        for name, g in expected.items():
            assert torch.equal(grads[name], g), name
    stats = offload.stats
    if checkpointing:  # exactly the checkpointed input of each offloaded layer
        assert stats["bytes_offloaded"] == 2 * (2 * 64 * 128 * 4), stats
    else:
        assert stats["bytes_offloaded"] > 0 and set(stats["bytes_by_module"]) == {"mlp"}, stats
    assert stats["host_bytes"] == stats["bytes_offloaded"]  # one host buffer per offloaded tensor, reused
    offload.detach()
    assert type(model.model.layers[0]) is layer_class
    offload.synchronizer.bytes_offloaded = 0
    _model_step(model, ids)
    assert offload.synchronizer.bytes_offloaded == 0  # detached: nothing goes through the context


def test_attach_checks_its_layers():
    model = _llama()
    offload = activations.OffloadContext(model_layers=3, num_layers=1)
    with pytest.raises(SyncDictError, match="attach got 4 layers, but this OffloadContext was made for model_layers=3"):
        offload.attach(model.model.layers)
    with pytest.raises(TypeError, match="model.model.layers"):
        offload.attach(model.model)
    first = activations.OffloadContext(model_layers=4, num_layers=1)
    first.attach(model.model.layers)
    with pytest.raises(ValueError, match="already attached to an OffloadContext; detach"):
        activations.OffloadContext(model_layers=4, num_layers=1).attach(model.model.layers)
    first.detach()
    activations.OffloadContext(model_layers=4, num_layers=1).attach(model.model.layers)


def test_only_offloaded_layers_and_the_layers_whose_backward_the_schedule_acts_on_take_hooks():
    """Saved-tensor hooks cost Python per saved tensor (all of it, where the host bounds the step):
    offloaded layers take the full hooks, a layer at whose backward start a reload begins takes
    hooks that mark that start, and every other layer none. Seen from outside: hooks entered
    around the whole step see the tensors of the layers that have none of their own."""
    model, ids = _llama(8), torch.randint(0, 256, (1, 32), generator=torch.Generator().manual_seed(1))
    offload = activations.OffloadContext(model_layers=8, num_layers=2, min_offload_bytes=0)
    # offloaded: 0 and 1; reloaded when layers 5 and 6 begin their backward (n - k + i - 1)
    assert sorted(offload._marks) == [5, 6]
    seen, running = set(), []
    original = offload.layer

    def layer(i, module=None):
        running[:] = [i]
        return original(i, module)

    offload.layer = layer
    _, expected = _step(_llama(8), ids)
    with torch.autograd.graph.saved_tensors_hooks(lambda x: (seen.add(running[0]) if running else None, x)[1], lambda x: x):
        _, grads = _step(model, ids, offload)
    assert seen == {2, 3, 4, 7}
    assert [a for a in offload.stats["log"] if a[0] in ("release", "reload")] == [("release", 0), ("release", 1), ("reload", 1), ("reload", 0)]
    assert all(torch.equal(grads[n], expected[n]) for n in expected)


def test_auto_reload_points_are_fitted_after_calibration_and_stay_bitwise():
    """reload_ahead='auto': measured with the leanest schedule (one layer ahead), each layer's
    backward start timed, then the reload points fitted, after which only the layers the fitted
    schedule acts on keep hooks. Gradients stay bitwise throughout."""
    n, k = 8, 3
    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(1))
    expected_loss, expected = _step(_llama(n), ids)
    model = _llama(n)
    offload = activations.OffloadContext(model_layers=n, num_layers=k, reload_ahead="auto", min_offload_bytes=1024, calibration_steps=2)
    lean = default_sync_dict(n, k, reload_ahead=1)
    assert offload.synchronization_dict == lean
    assert sorted(offload._marks) == list(range(k, n))  # every layer's backward start is timed
    for step in range(5):
        model.zero_grad()
        loss, grads = _step(model, ids, offload)
        assert torch.equal(loss, expected_loss)
        assert all(torch.equal(grads[name], g) for name, g in expected.items())
        # the first step is not measured; the next two are; the fourth runs on the fitted points
        assert (offload.synchronizer.times is not None) == (step in (1, 2)), step
    assert sorted(offload._backward_s) == list(range(1, n)) and sorted(offload._reload_s) == list(range(k))
    assert all(v > 0 for v in offload._backward_s.values()) and all(v > 0 for v in offload._reload_s.values())
    fitted = offload.synchronization_dict
    assert fitted == fitted_sync_dict(lean, n, offload._backward_s, offload._reload_s)
    acting = {e[3] for e in fitted.values()} - set(fitted)
    assert set(offload._marks) == acting


def test_auto_reload_arguments_are_checked():
    with pytest.raises(SyncDictError, match="reload_ahead must be an int >= 1 \\(layers\\) or 'auto', got 'soon'"):
        activations.OffloadContext(model_layers=4, num_layers=1, reload_ahead="soon")
    with pytest.raises(SyncDictError, match="reload_ahead='auto' fits the reload points of the num_layers schedule"):
        activations.OffloadContext(model_layers=4, synchronization_dict={0: (True, 2, False, 1)}, reload_ahead="auto")
    for bad in (0, True, 1.5):
        with pytest.raises(ValueError, match="calibration_steps must be an int >= 1"):
            activations.OffloadContext(model_layers=4, num_layers=1, reload_ahead="auto", calibration_steps=bad)
    # nothing offloaded: nothing to fit, no layer timed
    offload = activations.OffloadContext(model_layers=4, num_layers=0, reload_ahead="auto")
    assert offload._marks == {} and offload.synchronization_dict == {}


def test_step_times_subtract_the_waits_for_copies_from_a_layers_backward():
    from hostswap.runtime.activation_offload import StepTimes

    times = StepTimes(torch.device("cpu"))
    n = 4
    # points: fwd 0..3 at 0..3 s; bwd 3 at 4, bwd 2 at 6, bwd 1 at 9, bwd 0 at 10
    times.points = [(p, float(p)) for p in range(4)] + [(point(False, 3, n), 4.0), (point(False, 2, n), 6.0), (point(False, 1, n), 9.0), (point(False, 0, n), 10.0)]
    times.waits = [(6.5, 7.5), (1.0, 1.5)]  # one in layer 2's backward; one in the forward
    assert times.backward_seconds(n) == {3: 2.0, 2: 2.0, 1: 1.0}


def test_under_torch_compile_gradients_are_bitwise_the_compile_backends():
    """One implementation, two front ends: the same model compiled the same way (AOTAutograd)
    gives bitwise the same gradients with OffloadContext attached as with the activation
    offload backend offloading the same layers. (Eager and compiled differ from each other in
    the last bits, offload or not: AOTAutograd's decompositions of the loss.)"""
    import hostswap

    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(1))
    torch._dynamo.reset()
    backend = hostswap.activation_offload_backend(model_layers=4, num_layers=2, compiler="eager", min_tensor_size_to_offload=1024)
    _, through_backend = _model_step(torch.compile(_llama(), backend=backend), ids)
    torch._dynamo.reset()
    model = _llama()
    offload = activations.OffloadContext(model_layers=4, num_layers=2, min_offload_bytes=1024)
    offload.attach(model.model.layers)
    _, through_context = _model_step(torch.compile(model, backend="aot_eager"), ids)
    torch._dynamo.reset()
    assert backend.synchronizer.bytes_offloaded > 0 and offload.stats["bytes_offloaded"] > 0
    assert {"offload", "release", "reload"} <= {a for a, _ in offload.stats["log"]}
    assert through_backend.keys() == through_context.keys()
    for name, g in through_backend.items():
        assert torch.equal(through_context[name], g), name


def test_headroom_is_what_each_backward_start_holds_below_the_backwards_start():
    """What the leanest schedule measured, less the offloaded layer's own reload it holds at its
    backward start; the smallest over the measured steps; nothing where no allocator counts."""
    n = 4
    offload = activations.OffloadContext(model_layers=n, num_layers=1, reload_ahead="auto")
    offload._reload_bytes = {0: 10}
    offload._measure_headroom({})
    assert offload._headroom is None  # a machine without CUDA
    at = {point(False, 3, n): 1000, point(False, 2, n): 900, point(False, 1, n): 800, point(False, 0, n): 700}
    offload._measure_headroom(at)
    assert offload._headroom == {2: 100, 1: 200, 0: 310}
    offload._measure_headroom({**at, point(False, 1, n): 950})
    assert offload._headroom == {2: 100, 1: 50, 0: 310}


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_auto_reload_points_are_fitted_under_gradient_checkpointing(use_reentrant):
    """With transformers' checkpointing a layer's backward begins where it is recomputed; the
    calibration sees every layer's, fits, and the gradients stay those of checkpointing alone."""
    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(1))
    reference = _llama(6)
    reference.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
    _, expected = _model_step(reference, ids)
    model = _llama(6)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
    offload = activations.OffloadContext(model_layers=6, num_layers=2, reload_ahead="auto", min_offload_bytes=1024)
    offload.attach(model.model.layers)
    for _ in range(4):
        model.zero_grad()
        _, grads = _model_step(model, ids)
        assert all(torch.equal(grads[name], g) for name, g in expected.items())
    assert offload._fit_steps_left == 0 and sorted(offload._backward_s) == [1, 2, 3, 4, 5]
    assert offload.stats["bytes_offloaded"] > 0
