"""Allocators of the lru pool: per-weight blocks within the budget.

On CUDA the blocks come from a ``cudaMemPool_t`` whose maximum size is the budget, so the
driver itself refuses an allocation past the cap; frees are ordered on the copy stream.
"""

from __future__ import annotations

import time

import torch

from hostswap.runtime.pool import PoolCreationError, PoolStats
from hostswap.runtime.ptd import _cudart

class CudaMemPool:
    """Per-weight allocations from a cudaMemPool_t capped at the budget (cuda-python bindings)."""

    def __init__(self, device: torch.device, max_bytes: int):
        self.cudart = cudart = _cudart()
        props = cudart.cudaMemPoolProps()
        props.allocType = cudart.cudaMemAllocationType.cudaMemAllocationTypePinned
        props.location.type = cudart.cudaMemLocationType.cudaMemLocationTypeDevice
        props.location.id = device.index if device.index is not None else torch.cuda.current_device()
        props.maxSize = max_bytes
        err, self.pool = cudart.cudaMemPoolCreate(props)
        self._check(err, f"cudaMemPoolCreate(maxSize={max_bytes})")
        # Keep freed memory in the pool: the budget is the cap, trimming would only add latency.
        uint64 = getattr(cudart, "cuuint64_t", None)
        if uint64 is None:
            from cuda.bindings import driver

            uint64 = driver.cuuint64_t
        threshold = uint64(max_bytes)
        (err,) = cudart.cudaMemPoolSetAttribute(self.pool, cudart.cudaMemPoolAttr.cudaMemPoolAttrReleaseThreshold, threshold)
        self._check(err, "cudaMemPoolSetAttribute(ReleaseThreshold)")
        self.device = device
        self.max_bytes = max_bytes

    def _check(self, err, what: str) -> None:
        if err != self.cudart.cudaError_t.cudaSuccess:
            self.cudart.cudaGetLastError()
            _, name = self.cudart.cudaGetErrorName(err)
            raise PoolCreationError(f"{what} failed: {name.decode()}")

    def try_alloc(self, nbytes: int, stream: torch.cuda.Stream, stats: PoolStats | None = None) -> tuple[int, torch.Tensor] | None:
        """An allocation of ``nbytes`` ordered on ``stream``; None when the capped pool refuses."""
        t0 = time.perf_counter()
        err, ptr = self.cudart.cudaMallocFromPoolAsync(nbytes, self.pool, stream.cuda_stream)
        if stats is not None:
            stats.allocations += 1
            stats.allocation_seconds += time.perf_counter() - t0
        if err == self.cudart.cudaError_t.cudaErrorMemoryAllocation:
            self.cudart.cudaGetLastError()
            return None
        self._check(err, f"cudaMallocFromPoolAsync({nbytes} bytes)")
        ptr = int(ptr)
        return ptr, torch.as_tensor(_CudaArray(ptr, nbytes), device=self.device)

    def trim(self, stream: torch.cuda.Stream, wait: bool) -> None:
        """Hand wholly free chunks back to the driver, so that a block larger than any free
        block inside the reserved chunks can be mapped within the cap. A chunk is released
        only once the frees ordered on it have happened: ``wait`` waits for ``stream`` first."""
        if wait:
            stream.synchronize()
        (err,) = self.cudart.cudaMemPoolTrimTo(self.pool, 0)
        self._check(err, "cudaMemPoolTrimTo")

    def free(self, ptr: int, stream: torch.cuda.Stream) -> None:
        (err,) = self.cudart.cudaFreeAsync(ptr, stream.cuda_stream)
        self._check(err, "cudaFreeAsync")

    def close(self) -> None:
        torch.cuda.synchronize(self.device)
        self.cudart.cudaMemPoolDestroy(self.pool)


class _CudaArray:
    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3, "strides": None}


class HostAllocator:
    """The lru allocator off CUDA: one tensor per weight; the byte cap is the policy's."""

    def __init__(self, device: torch.device, max_bytes: int):
        self.device = device

    def try_alloc(self, nbytes: int, stream, stats: PoolStats | None = None) -> tuple[None, torch.Tensor]:
        return None, torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def trim(self, stream, wait: bool) -> None:
        pass

    def free(self, handle, stream) -> None:
        pass

    def close(self) -> None:
        pass
