"""Loads corrupted copies of a saved program, one case per line of stdin; prints one JSON
result per case. Run by tests/test_artifact_fuzz.py in a subprocess, so that a crash or a
hang is seen as one (the parent restarts the worker after the case that killed it).

A case is {"case": i, "pte": path, "ptd": path}. The result's ``outcome``:
- ``refused``: ``ArtifactError`` (or ``BudgetError`` / ``ValueError`` naming an argument is
  not expected here, so any other type is ``unexpected``),
- ``same``: it loaded with ``verify=True`` and the output is bitwise the reference,
- ``wrong``: it loaded and answered differently: a silent wrong answer.
"""

from __future__ import annotations

import json
import sys

import torch


def main() -> int:
    reference_path = sys.argv[1]
    reference = torch.load(reference_path)
    x, expected = reference["x"], reference["y"]
    from hostswap.runtime import Module
    from hostswap.schedules.artifacts import ArtifactError

    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        case = json.loads(line)
        print(json.dumps({"starting": case["case"]}), flush=True)
        result = {"case": case["case"]}
        try:
            with Module(case["pte"], case["ptd"], weight_offload_budget_mb=1, device="cpu", verify=True) as m:
                y = m(x)
            result["outcome"] = "same" if torch.equal(y, expected) else "wrong"
        except ArtifactError as e:
            names_a_file = e.path in (case["pte"], case["ptd"])
            result.update(outcome="refused" if names_a_file else "unexpected", type="ArtifactError", message=str(e)[:300])
        except Exception as e:  # noqa: BLE001  what the test is looking for
            result.update(outcome="unexpected", type=type(e).__name__, message=str(e)[:300])
        print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
