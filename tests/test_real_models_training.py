"""The activation offload backend on transformers training steps (CPU: the same pass and
synchronizer logic with host tensors): bitwise against the same compiled step without
offload, and a warning with the numbers when it offloads much less than asked."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import hostswap
from real_models import BY_NAME, build

pytest.importorskip("transformers")

TRAINED = ("GPT-2", "Llama")


def _step(model, backend, ids, steps=2):
    model = copy.deepcopy(model)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend)
    results = []
    for _ in range(steps):
        loss = compiled(ids, labels=ids).loss
        loss.backward()
        results.append((loss.detach().clone(), [p.grad.clone() for p in model.parameters() if p.grad is not None]))
        for p in model.parameters():
            p.grad = None
    return results


@pytest.mark.parametrize("name", TRAINED)
def test_training_step_offloaded_bitwise(name):
    model, (ids,), _ = build(BY_NAME[name])  # eval(): dropout off, so steps are deterministic
    reference = _step(model, hostswap.activation_offload_backend(model_layers=2, num_layers=0, compiler="eager"), ids)
    backend = hostswap.activation_offload_backend(model_layers=2, num_layers=1, compiler="eager", min_tensor_size_to_offload=0)
    offloaded = _step(model, backend, ids)
    for (loss_a, grads_a), (loss_b, grads_b) in zip(reference, offloaded):
        assert torch.equal(loss_a, loss_b)
        assert len(grads_a) == len(grads_b) > 0
        assert all(torch.equal(a, b) for a, b in zip(grads_a, grads_b))
    stats = backend.stats
    assert stats["layers_offloaded"] == [0]
    assert stats["offloaded_bytes"] > 0 and stats["offloaded_fraction"] == 1.0
    assert stats["transfer_seconds"] > 0  # the last step's copies to host and back
    assert backend.synchronizer.bytes_offloaded > 0
    log = [a for a in backend.synchronizer.log if a[0] in ("release", "reload")]
    assert log == [("release", 0), ("reload", 0)]


@pytest.mark.parametrize("name", TRAINED)
def test_backend_says_when_it_offloads_less_than_asked(name):
    """A tiny model's activations are all under the default 1 MiB minimum: the backend warns
    with the numbers and its stats show the fraction offloaded."""
    model, (ids,), _ = build(BY_NAME[name])
    backend = hostswap.activation_offload_backend(model_layers=2, num_layers=1, compiler="eager")
    with pytest.warns(hostswap.OffloadCoverageWarning, match=r"layers \[0\]: 0 bytes offloaded, \d+ bytes"):
        _step(model, backend, ids, steps=1)
    stats = backend.stats
    assert stats["offloaded_bytes"] == 0 and stats["kept_bytes_in_offloaded_layers"] > 0
    assert stats["offloaded_fraction"] == 0.0
    full = hostswap.activation_offload_backend(model_layers=2, num_layers=1, compiler="eager", min_tensor_size_to_offload=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", hostswap.OffloadCoverageWarning)
        _step(model, full, ids, steps=1)


def test_named_layer_list_with_a_graph_break():
    """GPT-2's loss compiles as a graph of its own that holds no block: with layers= named,
    it compiles without offload instead of being refused."""
    model, (ids,), _ = build(BY_NAME["GPT-2"])
    backend = hostswap.activation_offload_backend(model_layers=2, num_layers=1, compiler="eager", min_tensor_size_to_offload=0, layers="h")
    _step(model, backend, ids, steps=1)
    assert backend.stats["graphs_without_layers"] >= 1 and backend.stats["offloaded_bytes"] > 0
    assert backend.groups, "the groups reported are those of the graph holding the layers"


def test_model_without_a_layer_list_is_said_to_offload_nothing():
    model = torch.nn.Linear(8, 8)
    backend = hostswap.activation_offload_backend(model_layers=2, num_layers=1, compiler="eager")
    torch._dynamo.reset()
    with pytest.warns(hostswap.OffloadCoverageWarning, match="holds no block of a repeated layer list"):
        torch.compile(model, backend=backend)(torch.randn(2, 8)).sum().backward()
    assert backend.stats["offloaded_bytes"] == 0 and backend.stats["graphs_without_layers"] == 1
