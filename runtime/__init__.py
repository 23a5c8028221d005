"""The companion runtime: .ptd mapping and registration, device pool, .pte executor."""

from hostswap.runtime.executor import MethodExecutor, ProgramError
from hostswap.runtime.module import ConcurrentExecutionError, Module
from hostswap.runtime.lru_pool import LruPool
from hostswap.runtime.planned_pool import PlannedPool
from hostswap.runtime.pool import PoolCreationError, PoolStats, ScheduleDivergenceError, WeightPool
from hostswap.runtime.ptd import HostRegistrationError, PtdError, PtdFile
from hostswap.schedules.policies import BudgetError

__all__ = [
    "BudgetError", "ConcurrentExecutionError", "HostRegistrationError", "LruPool", "MethodExecutor", "Module",
    "PlannedPool", "PoolCreationError", "PoolStats", "ProgramError", "PtdError", "PtdFile", "ScheduleDivergenceError", "WeightPool",
]
