"""The companion runtime: .ptd mapping and registration, device pool, .pte executor."""

from hostswap.runtime.budget import load_floor_on
from hostswap.runtime.executor import MethodExecutor, ProgramError
from hostswap.runtime.module import ConcurrentExecutionError, Module, ModuleClosedError
from hostswap.runtime.lru_pool import LruPool
from hostswap.runtime.planned_pool import PlannedPool
from hostswap.runtime.pool import PoolCreationError, PoolStats, ScheduleDivergenceError, WeightPool
from hostswap.runtime.ptd import HostRegistrationError, PtdFile
from hostswap.schedules.artifacts import ArtifactError
from hostswap.schedules.policies import BudgetError

__all__ = [
    "ArtifactError", "BudgetError", "ConcurrentExecutionError", "HostRegistrationError", "LruPool", "MethodExecutor", "Module",
    "ModuleClosedError", "PlannedPool", "PoolCreationError", "PoolStats", "ProgramError", "PtdFile", "ScheduleDivergenceError", "WeightPool",
    "load_floor_on",
]
