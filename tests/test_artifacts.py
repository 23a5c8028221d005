"""Trusting the files: the .ptd index is validated, the .pte and .ptd must be one save's pair,
every byte can be verified, and a Module releases what it holds deterministically."""

from __future__ import annotations

import gc
import os
import shutil
import struct
import subprocess
import sys

import pytest
import torch

import hostswap
from hostswap.runtime import Module, ModuleClosedError
from hostswap.runtime.ptd import PtdFile, page_ranges
from hostswap.schedules.artifacts import ArtifactError, FlatbufferReader
from hostswap.schedules.checksums import TRAILER_FOOTER
from hostswap.schedules.ptd_index import read_ptd_index

MB = 2**20


def _copy(lowered, tmp_path, name="m"):
    pte, ptd = tmp_path / f"{name}.pte", tmp_path / f"{name}.ptd"
    shutil.copy(lowered.pte, pte)
    shutil.copy(lowered.ptd, ptd)
    return pte, ptd


def _load(pte, ptd, **kw):
    return Module(pte, ptd, weight_offload_budget_mb=kw.pop("budget", 64), device="cpu", **kw)


class PtdFields:
    """Byte positions of the index fields of a .ptd, to corrupt one at a time."""

    def __init__(self, path):
        self.path = path
        self.data = bytearray(open(path, "rb").read())
        self.index = read_ptd_index(lambda o, n: bytes(self.data[o : o + n]), len(self.data), str(path))
        root = FlatbufferReader(bytes(self.data[: self.index.segment_base]), str(path)).root()
        self.segments = root.tables(1, "segments")
        self.named = root.tables(2, "named_data")

    def position(self, table, index, name):
        at = table._slot(index, name)
        assert at is not None, f"field {name} is stored as its default; pick another entry"
        return at

    def set(self, at, size, value):
        self.data[at : at + size] = value.to_bytes(size, "little")

    def write(self):
        with open(self.path, "wb") as f:
            f.write(self.data)


def _entry(fields, predicate):
    """(i, named table, key) of the first named_data entry whose fields are all stored."""
    for i, named in enumerate(fields.named):
        key = named.string(0, "key")
        if predicate(key, named):
            return i, named, key
    raise AssertionError("no such entry")


# --- the .ptd index, validated without reading a weight -------------------------------------------------
def test_index_entry_outside_the_file(lowered_by_name, tmp_path):
    pte, ptd = _copy(lowered_by_name("demo_transformer"), tmp_path)
    f = PtdFields(ptd)
    seg = f.segments[3]
    f.set(f.position(seg, 0, "offset"), 8, len(f.data) * 2)
    f.write()
    with pytest.raises(ArtifactError, match=r"m.ptd: segments\[3\]: bytes \d+\.\.\d+ lie outside the \d+-byte segment region"):
        _load(pte, ptd)


def test_index_overlapping_segments(lowered_by_name, tmp_path):
    pte, ptd = _copy(lowered_by_name("demo_transformer"), tmp_path)
    f = PtdFields(ptd)
    second = f.segments[2].scalar(0, "offset", 8)
    f.set(f.position(f.segments[3], 0, "offset"), 8, second)  # segment 3 now starts where segment 2 does
    f.write()
    with pytest.raises(ArtifactError, match=r"segments\[\d\]: bytes .* overlap segments\[\d\]"):
        _load(pte, ptd)


def test_index_size_disagrees_with_the_shape(lowered_by_name, tmp_path):
    pte, ptd = _copy(lowered_by_name("demo_transformer"), tmp_path)
    f = PtdFields(ptd)
    i, named, key = _entry(f, lambda key, n: n.scalar(1, "segment_index", 4) > 0)
    seg = f.segments[named.scalar(1, "segment_index", 4)]
    f.set(f.position(seg, 1, "size"), 8, seg.scalar(1, "size", 8) - 4)
    f.write()
    with pytest.raises(ArtifactError, match=rf"named_data\[{i}\] '{key}': segment \d+ holds \d+ bytes; shape \[.*\] torch.float32 needs \d+"):
        _load(pte, ptd)


def test_index_misaligned_segment(lowered_by_name, tmp_path):
    pte, ptd = _copy(lowered_by_name("demo_transformer"), tmp_path)
    f = PtdFields(ptd)
    seg = f.segments[3]
    f.set(f.position(seg, 0, "offset"), 8, seg.scalar(0, "offset", 8) + 4)
    f.write()
    with pytest.raises(ArtifactError, match=r"segments\[3\]: offset \d+ is not a multiple of 16"):
        _load(pte, ptd)


def test_index_entry_pointing_at_another_weights_bytes(lowered_by_name, tmp_path):
    # The attack the sizes cannot catch: a key pointed at another weight's segment of the
    # same size. Keys sharing a segment must carry the same checksum, so the index refuses it.
    pte, ptd = _copy(lowered_by_name("demo_transformer"), tmp_path)
    f = PtdFields(ptd)
    entries = f.index.entries
    target = next(k for k in entries if k.endswith("q_proj.weight") and ".1." in k)
    other = next(k for k in entries if k.endswith("k_proj.weight") and ".1." in k)
    assert entries[target].nbytes == entries[other].nbytes
    i, named, _ = _entry(f, lambda key, n: key == target)
    f.set(f.position(named, 1, "segment_index"), 4, entries[other].segment)
    f.write()
    with pytest.raises(ArtifactError, match=rf"named_data '({target}|{other})': points at segment {entries[other].segment}, which holds"):
        _load(pte, ptd)


def test_index_truncated_file(lowered_by_name, tmp_path):
    pte, ptd = _copy(lowered_by_name("demo_transformer"), tmp_path)
    size = os.path.getsize(ptd)
    with open(ptd, "r+b") as f:
        f.truncate(size // 2)
    with pytest.raises(ArtifactError, match=r"m.ptd: segment data size: the header promises segments up to byte \d+, the file has \d+ bytes: truncated"):
        _load(pte, ptd)


def test_index_corrupt_flatbuffer_names_the_field(lowered_by_name, tmp_path):
    pte, ptd = _copy(lowered_by_name("demo_transformer"), tmp_path)
    data = bytearray(ptd.read_bytes())
    data[0:4] = struct.pack("<I", len(data) + 100)  # the root offset points past the file
    ptd.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match=r"m.ptd: index root \(table\): reads 4 bytes at offset \d+, outside"):
        _load(pte, ptd)


def test_ptd_without_checksums_is_refused(lowered_by_name, tmp_path):
    pte, ptd = _copy(lowered_by_name("demo_transformer"), tmp_path)
    data = ptd.read_bytes()
    length, _ = TRAILER_FOOTER.unpack(data[-TRAILER_FOOTER.size :])
    ptd.write_bytes(data[: -(length + TRAILER_FOOTER.size)])  # what ExecuTorch alone writes
    with pytest.raises(ArtifactError, match="m.ptd: checksum trailer: is missing"):
        _load(pte, ptd)


def test_page_ranges_merge_and_align():
    # touching pages merge into one registration; a gap of a page keeps two
    assert page_ranges([(10, 5), (4090, 20), (9000, 10)], 4096) == [(0, 12288)]
    assert page_ranges([(20000, 10), (10, 5)], 4096) == [(0, 4096), (16384, 4096)]
    assert page_ranges([], 4096) == []


# --- program <-> weights identity --------------------------------------------------------------------
def _twin(tmp_path, random_state):
    torch.manual_seed(random_state)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8)).eval()
    x = torch.randn(3, 16)
    pte, ptd = hostswap.save(hostswap.apply_weight_offload(torch.export.export(model, (x,))), tmp_path / f"twin{random_state}")
    return model, x, pte, ptd


def test_weights_of_another_program_with_the_same_names_and_shapes(tmp_path):
    _, _, a_pte, _ = _twin(tmp_path, 0)
    _, _, _, b_ptd = _twin(tmp_path, 1)
    with pytest.raises(ArtifactError, match=r"twin1.ptd: weights digest: is [0-9a-f]+; .*twin0.pte was saved with weights of digest [0-9a-f]+: the weights file belongs to another program"):
        _load(a_pte, b_ptd)


def test_a_corrupt_pte_is_refused_by_its_checksum(tmp_path):
    model, x, pte, ptd = _twin(tmp_path, 0)
    data = bytearray(open(pte, "rb").read())
    # a byte of a constant method's string: the program still parses and decodes
    at = data.index(b"hostswap_methods")
    data[at + 9] ^= 0x20
    open(pte, "wb").write(bytes(data))
    with pytest.raises(ArtifactError, match=r"twin0.pte: (file: its checksum [0-9a-f]+ differs|hostswap_)"):
        _load(pte, ptd)


# --- verification of every byte ----------------------------------------------------------------------
def _flip(ptd_path, fqn, bit=6):
    """Flip an exponent bit of the float32 in the middle of weight ``fqn``."""
    weights = PtdFile(ptd_path)
    offset = weights.entries[fqn].offset + weights.entries[fqn].nbytes // 8 * 4 + 3
    weights.close()
    with open(ptd_path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ (1 << bit)]))


def test_verify_detects_a_flipped_bit_and_names_the_weight(tmp_path):
    model, x, pte, ptd = _twin(tmp_path, 0)
    m = _load(pte, ptd, verify=True)
    assert m.verified_bytes == sum(p.numel() * 4 for p in model.parameters())
    assert torch.equal(m(x), model(x))
    m.close()
    _flip(ptd, "2.bias")  # added to the output as it is
    with pytest.raises(ArtifactError, match=r"twin0.ptd: weight '2.bias': its bytes do not match the checksum stored at save \(1 of 4 weights differ"):
        _load(pte, ptd, verify=True)
    # without verify=True a flipped data bit is not looked for (README: "Trusting the files")
    with _load(pte, ptd) as m:
        assert not torch.equal(m(x), model(x))


def test_verify_cli(tmp_path):
    _, _, pte, ptd = _twin(tmp_path, 0)
    run = lambda *a: subprocess.run([sys.executable, "-m", "hostswap.cli", "verify", *map(str, a)], capture_output=True, text=True)
    ok = run(pte)
    assert ok.returncode == 0, ok.stderr
    assert "4 weights" in ok.stdout and "match their checksums" in ok.stdout and "GB/s" in ok.stdout
    _flip(ptd, "0.bias")
    bad = run(pte, ptd)
    assert bad.returncode == 1
    assert "hostswap verify: " in bad.stderr and "weight '0.bias'" in bad.stderr


def test_inspect_checks_the_pair(tmp_path):
    _, _, a_pte, _ = _twin(tmp_path, 0)
    _, _, _, b_ptd = _twin(tmp_path, 1)
    out = subprocess.run([sys.executable, "-m", "hostswap.cli", "inspect", str(a_pte), "--ptd", str(b_ptd)], capture_output=True, text=True)
    assert out.returncode == 2 and "belongs to another program" in out.stderr
    garbage = tmp_path / "garbage.pte"
    garbage.write_bytes(os.urandom(4096))
    out = subprocess.run([sys.executable, "-m", "hostswap.cli", "inspect", str(garbage)], capture_output=True, text=True)
    assert out.returncode == 2 and "garbage.pte: identifier:" in out.stderr, out.stderr


# --- a file changed under a running process ----------------------------------------------------------
def test_file_changed_after_load_is_refused_at_the_next_call(tmp_path):
    model, x, pte, ptd = _twin(tmp_path, 0)
    m = _load(pte, ptd)
    assert torch.equal(m(x), model(x))
    with open(ptd, "ab") as f:
        f.write(b"\0" * 16)
    with pytest.raises(ArtifactError, match=r"twin0.ptd: file: changed on disk since it was loaded \(size \d+ -> \d+ bytes"):
        m(x)
    m.close()


def test_file_rewritten_in_place_is_refused(tmp_path):
    model, x, pte, ptd = _twin(tmp_path, 0)
    m = _load(pte, ptd)
    stat = os.stat(ptd)
    os.utime(ptd, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # what a write in place does
    with pytest.raises(ArtifactError, match="changed on disk since it was loaded"):
        m(x)
    m.close()


# --- deterministic release ---------------------------------------------------------------------------
def _mapped(path) -> bool:
    real = os.path.realpath(path)
    with open("/proc/self/maps") as f:
        return any(line.rstrip().endswith(real) for line in f)


def test_close_unmaps_and_a_closed_module_refuses_calls(tmp_path):
    model, x, pte, ptd = _twin(tmp_path, 0)
    m = _load(pte, ptd)
    y = m(x)
    assert _mapped(ptd)
    m.close()
    assert not _mapped(ptd)
    assert torch.equal(y, model(x))  # outputs returned before close are the caller's
    with pytest.raises(ModuleClosedError, match="was closed; load it again"):
        m(x)
    m.close()  # idempotent


def test_context_manager_releases(tmp_path):
    model, x, pte, ptd = _twin(tmp_path, 0)
    with _load(pte, ptd) as m:
        assert _mapped(ptd)
        m(x)
    assert not _mapped(ptd)


def test_dropping_the_last_reference_releases_without_the_garbage_collector(tmp_path):
    model, x, pte, ptd = _twin(tmp_path, 0)
    gc.collect()
    gc.disable()
    try:
        m = _load(pte, ptd)
        m(x)
        assert _mapped(ptd)
        del m
        assert not _mapped(ptd), "a reference cycle keeps the Module alive until the garbage collector runs"
    finally:
        gc.enable()


def test_failed_load_releases(tmp_path):
    _, _, a_pte, _ = _twin(tmp_path, 0)
    _, _, _, b_ptd = _twin(tmp_path, 1)
    with pytest.raises(ArtifactError):
        _load(a_pte, b_ptd)
    assert not _mapped(b_ptd)


def test_generator_close(tmp_path):
    from hostswap.models import tiny_llama

    import hostswap.llm as llm

    model = tiny_llama()
    pte, ptd = llm.export(model, tmp_path / "lm", max_seq_len=16, prefill_chunk=4)
    floor = hostswap.schedules.load_weight_schedule(pte, "decode").floor_bytes
    with llm.Generator(pte, ptd, weight_offload_budget_mb=2 * floor / MB, device="cpu") as g:
        g.generate(torch.tensor([[1, 2, 3]]), 2)
        assert _mapped(ptd)
    assert not _mapped(ptd)
    with pytest.raises(ModuleClosedError):
        g.generate(torch.tensor([[1, 2, 3]]), 2)


class _Interrupted(Exception):
    pass


@pytest.mark.parametrize("stage", ["hashing the weights", "both files written"])
def test_an_interrupted_save_leaves_nothing_under_the_final_names(tmp_path, stage):
    """Interrupted while lowering, or with both files written but not yet moved: no file under
    the final names, no temporary file left, and an earlier pair there stays loadable."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4)).eval()
    x = torch.randn(2, 8)
    ep = hostswap.apply_weight_offload(torch.export.export(model, (x,)))

    def interrupt(message):
        if message.startswith(stage):
            raise _Interrupted(message)

    with pytest.raises(_Interrupted):
        hostswap.save(ep, tmp_path / "new", progress=interrupt)
    assert os.listdir(tmp_path) == []
    pte, ptd = hostswap.save(ep, tmp_path / "old")
    before = {p: open(p, "rb").read() for p in (pte, ptd)}
    with pytest.raises(_Interrupted):
        hostswap.save(ep, tmp_path / "old", progress=interrupt)
    assert sorted(os.listdir(tmp_path)) == ["old.ptd", "old.pte"]
    assert all(open(p, "rb").read() == data for p, data in before.items())
    with _load(pte, ptd) as m:
        torch.testing.assert_close(m(x), model(x), rtol=1e-6, atol=1e-6)
