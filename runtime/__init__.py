"""The companion runtime: .ptd mapping and registration, device pool, .pte executor."""

from hostswap.runtime.executor import MethodExecutor, ProgramError
from hostswap.runtime.module import ConcurrentExecutionError, Module
from hostswap.runtime.pool import PoolCreationError, PoolStats, ScheduleDivergenceError, WeightPool
from hostswap.runtime.ptd import HostRegistrationError, PtdError, PtdFile
from hostswap.schedules.policies import BudgetError

__all__ = [
    "BudgetError", "ConcurrentExecutionError", "HostRegistrationError", "MethodExecutor", "Module",
    "PoolCreationError", "PoolStats", "ProgramError", "PtdError", "PtdFile", "ScheduleDivergenceError", "WeightPool",
]
