"""Find the first instruction whose result differs between the CPU and CUDA executors."""
import sys, tempfile, os
import torch
import hostswap
from hostswap import models
from hostswap.runtime import Module

m = models.ConvNet(); x = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(1))
d = tempfile.mkdtemp()
pte, ptd = hostswap.save(hostswap.apply_weight_offload(torch.export.export(m, (x,))), os.path.join(d, "c"))
results = {}
for dev in ("cpu", "cuda"):
    mod = Module(pte, ptd, weight_offload_budget_mb=10, device=dev)
    ex = mod._executors["forward"]
    rec = []
    orig = ex.run
    def on_kernel(i, ex=ex, rec=rec, mod=mod):
        ins = ex.instructions[i]
        rec.append((i, str(ins[1]), [ex.values[r].detach().float().cpu().clone() if isinstance(ex.values[r], torch.Tensor) else None for r in ins[4]]))
        mod._on_kernel(i)
    ex.bind_inputs([x.to(dev)])
    mod.pool.begin_forward(); ex.run(on_kernel); mod.pool.end_forward()
    results[dev] = rec
for (i, name, a), (_, _, b) in zip(results["cpu"], results["cuda"]):
    diffs = [(ta - tb).abs().max().item() for ta, tb in zip(a, b) if ta is not None and ta.shape == tb.shape]
    print(i, name, diffs, [tuple(t.shape) for t in a if t is not None], [tuple(t.stride()) for t in b if t is not None])
