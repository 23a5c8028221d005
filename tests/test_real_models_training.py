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
