"""Hostile and careless files: 240 corrupted, truncated, swapped and foreign .pte/.ptd pairs,
each loaded with ``verify=True`` in a worker subprocess. Every case must be refused with an
``ArtifactError`` naming one of the two files, or load and answer bitwise as the intact pair
does (a flip in padding changes nothing). No crash, no hang, no other exception type, and
no wrong answer."""

from __future__ import annotations

import json
import os
import queue
import random
import subprocess
import sys
import threading

import torch

import hostswap
from hostswap.schedules.ptd_index import read_ptd_index

CASES = 240
CASE_TIMEOUT_S = 60


def _save(tmp_path, random_state):
    torch.manual_seed(random_state)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8)).eval()
    x = torch.randn(3, 16)
    pte, ptd = hostswap.save(hostswap.apply_weight_offload(torch.export.export(model, (x,))), tmp_path / f"m{random_state}")
    return model, x, open(pte, "rb").read(), open(ptd, "rb").read()


def _flip(data: bytes, rng, lo=0, hi=None) -> bytes:
    hi = len(data) if hi is None else hi
    b = bytearray(data)
    at = rng.randrange(lo, hi)
    b[at] ^= 1 << rng.randrange(8)
    return bytes(b)


def _mutations(pte: bytes, ptd: bytes, other_ptd: bytes):
    index = read_ptd_index(lambda o, n: ptd[o : o + n], len(ptd), "m.ptd")
    base, end = index.segment_base, index.data_end
    return {
        "pte bit flip": lambda r: (_flip(pte, r), ptd),
        "pte truncated": lambda r: (pte[: r.randrange(len(pte))], ptd),
        "pte garbage": lambda r: (r.randbytes(r.randrange(1, 4096)), ptd),
        "ptd header bit flip": lambda r: (pte, _flip(ptd, r, 0, 48)),
        "ptd index bit flip": lambda r: (pte, _flip(ptd, r, 48, base)),
        "ptd index bytes overwritten": lambda r: (pte, _overwrite(ptd, r, 0, base)),
        "ptd data bit flip": lambda r: (pte, _flip(ptd, r, base, end)),
        "ptd trailer bit flip": lambda r: (pte, _flip(ptd, r, end)),
        "ptd truncated": lambda r: (pte, ptd[: r.randrange(len(ptd))]),
        "ptd appended": lambda r: (pte, ptd + r.randbytes(r.randrange(1, 64))),
        "ptd of another program": lambda r: (pte, other_ptd),
        "ptd garbage": lambda r: (pte, r.randbytes(r.randrange(1, 8192))),
    }


def _overwrite(data: bytes, rng, lo, hi) -> bytes:
    b = bytearray(data)
    at = rng.randrange(lo, hi - 8)
    b[at : at + 8] = rng.randbytes(8)
    return bytes(b)


class Worker:
    def __init__(self, reference):
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.fuzz_worker", reference], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True, env=env, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        self.lines = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        assert "ready" in (self._line(120) or {}), "the fuzz worker did not start"

    def _read(self):
        for line in self.proc.stdout:
            self.lines.put(json.loads(line))
        self.lines.put({})  # the worker exited

    def _line(self, timeout):
        """The worker's next message; None when it said nothing for ``timeout`` s, {} when it died."""
        try:
            return self.lines.get(timeout=timeout)
        except queue.Empty:
            return None

    def run(self, case) -> dict:
        self.proc.stdin.write(json.dumps(case) + "\n")
        self.proc.stdin.flush()
        started = self._line(CASE_TIMEOUT_S)
        result = self._line(CASE_TIMEOUT_S) if started else None
        if result is None:
            self.proc.kill()
            return {"case": case["case"], "outcome": "hang"}
        if not result:
            return {"case": case["case"], "outcome": "crash", "returncode": self.proc.wait()}
        return result

    def close(self):
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)


def test_fuzzed_artifacts_are_refused_or_answer_the_same(tmp_path):
    model, x, pte, ptd = _save(tmp_path, 0)
    *_, other_ptd = _save(tmp_path, 1)
    reference = tmp_path / "reference.pt"
    torch.save({"x": x, "y": model(x).detach()}, reference)
    mutations = _mutations(pte, ptd, other_ptd)
    names = list(mutations)
    rng = random.Random(0)
    cases = []
    for i in range(CASES):
        kind = names[i % len(names)]
        bad_pte, bad_ptd = mutations[kind](rng)
        folder = tmp_path / f"case{i}"
        folder.mkdir()
        (folder / "m.pte").write_bytes(bad_pte)
        (folder / "m.ptd").write_bytes(bad_ptd)
        cases.append({"case": i, "kind": kind, "pte": str(folder / "m.pte"), "ptd": str(folder / "m.ptd")})
    worker = Worker(str(reference))
    results = []
    for case in cases:
        result = worker.run({k: case[k] for k in ("case", "pte", "ptd")})
        result["kind"] = case["kind"]
        results.append(result)
        if result["outcome"] in ("hang", "crash"):
            worker = Worker(str(reference))
    worker.close()
    bad = [r for r in results if r["outcome"] not in ("refused", "same")]
    by_kind = {}
    for r in results:
        by_kind.setdefault(r["kind"], {}).setdefault(r["outcome"], 0)
        by_kind[r["kind"]][r["outcome"]] += 1
    print(json.dumps(by_kind, indent=1))
    assert len(results) == CASES >= 200
    assert not bad, f"{len(bad)} cases neither refused nor answering the same: {bad[:5]}"
    # the mutations that always change what the program reads are always refused
    for kind in ("pte truncated", "ptd data bit flip", "ptd of another program", "ptd truncated", "pte garbage", "ptd garbage"):
        assert by_kind[kind] == {"refused": by_kind[kind].get("refused")}, (kind, by_kind[kind])
