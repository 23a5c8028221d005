"""Per-weight checksums and the weights digest that ties a ``.pte`` to its ``.ptd``.

``hostswap.save`` hashes every streamed weight once (xxHash's XXH3, at memory speed). The
digest is a hash over each weight's name, dtype, shape and checksum: the ``.pte`` carries it
as a constant method, and the ``.ptd`` carries the per-weight checksums in a trailer after
ExecuTorch's segments, which ExecuTorch's own loader does not read. At load, recomputing the
digest from the trailer and the ``.ptd`` index refuses a weights file written for another
program without reading any weight; ``verify=True`` re-hashes every byte against the
checksums.
"""

from __future__ import annotations

import json
import struct

import torch
import xxhash

ALGORITHM = "xxh3_64"
TRAILER_MAGIC = b"HSWCKS01"
TRAILER_FOOTER = struct.Struct("<Q8s")  # JSON length, magic: the last 16 bytes of the .ptd
MAX_TRAILER_BYTES = 64 * 2**20  # a bound on what a corrupt length may make load read


def checksum(data) -> str:
    """XXH3-64 of a buffer (a memoryview or numpy array), as 16 hex digits."""
    return xxhash.xxh3_64_hexdigest(data)


def tensor_checksum(tensor: torch.Tensor) -> str:
    """The checksum of a tensor's bytes as ExecuTorch stores them (contiguous, row-major)."""
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return checksum(t.contiguous().reshape(-1).view(torch.uint8).numpy())


def weights_digest(records: dict[str, tuple[str, tuple[int, ...], str]]) -> str:
    """XXH3-128 over (name, dtype, shape, checksum) of every weight, in name order."""
    h = xxhash.xxh3_128()
    for fqn in sorted(records):
        dtype, shape, sum_ = records[fqn]
        h.update(f"{fqn}\0{dtype}\0{','.join(map(str, shape))}\0{sum_}\n".encode())
    return h.hexdigest()


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def encode_trailer(checksums: dict[str, str], program_checksum: str) -> bytes:
    """The trailer: each weight's checksum, and the checksum of the ``.pte`` saved with them."""
    body = json.dumps({"algorithm": ALGORITHM, "checksums": checksums, "program": program_checksum}, sort_keys=True).encode()
    return body + TRAILER_FOOTER.pack(len(body), TRAILER_MAGIC)
