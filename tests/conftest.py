import os

# Tests run in several worker processes (pytest -n): one intra-op thread each, so the workers
# and the processes they start do not oversubscribe the cores (set before torch is imported).
IN_A_WORKER = bool(os.environ.get("PYTEST_XDIST_WORKER"))
if IN_A_WORKER:
    os.environ["OMP_NUM_THREADS"] = "1"

import pytest
import torch

if IN_A_WORKER:
    torch.set_num_threads(1)

import hostswap
from hostswap import models


def _has_cuda() -> bool:
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# name -> (factory, expected number of (consumer, weight) uses)
def _demo():
    return models.demo_transformer(random_state=0)


def _conv():
    return models.ConvNet(), (torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(1)),)


def _tied():
    return models.TiedLM(), (torch.randint(0, 512, (2, 8), generator=torch.Generator().manual_seed(1)),)


def _nonuniform():
    return models.NonUniformMLP(), (torch.randn(4, 32, generator=torch.Generator().manual_seed(1)),)


MODELS = {
    # 4 layers x (2 norms x 2 + 6 linears x 2) + final norm x 2 + lm_head; the token and
    # position embeddings are read in place from host memory (row gathers), unprobed
    "demo_transformer": (_demo, 4 * 16 + 2 + 1),
    # 3 convs x (w, b) + 3 batch norms x (w, b, running mean, running var) + classifier (w, b)
    "convnet": (_conv, 6 + 12 + 2),
    # embedding and head share one weight: two uses; mix (w, b)
    "tied": (_tied, 4),
    # 4 linears x (w, b) + scale buffer + fused.weight read a second time
    "nonuniform": (_nonuniform, 8 + 1 + 1),
}


class Lowered:
    def __init__(self, name, tmp_path_factory):
        self.name = name
        factory, self.expected_uses = MODELS[name]
        self.model, self.args = factory()
        self.expected = self.model(*self.args)
        self.ep = hostswap.apply_weight_offload(torch.export.export(self.model, self.args))
        self.pass_schedule = hostswap.get_weight_schedule(self.ep)
        out = tmp_path_factory.mktemp(name)
        self.pte, self.ptd = hostswap.save(self.ep, os.path.join(out, name))
        # what the runtime executes: probes re-derived from the lowered program's kernels
        self.schedule = hostswap.schedules.load_weight_schedule(self.pte)
        # Attention stays one kernel through lowering (passes/fused_attention.py), so the .pte
        # runs eager's own kernels: eager output is the bitwise reference for every model.
        self.lowered_expected = self.expected


_cache = {}


@pytest.fixture(scope="session", params=list(MODELS))
def lowered(request, tmp_path_factory):
    if request.param not in _cache:
        _cache[request.param] = Lowered(request.param, tmp_path_factory)
    return _cache[request.param]


@pytest.fixture(scope="session")
def lowered_by_name(tmp_path_factory):
    def get(name):
        if name not in _cache:
            _cache[name] = Lowered(name, tmp_path_factory)
        return _cache[name]

    return get
