"""What the passes emit and the runtime consumes: schedules, floor, (de)serialization, rendering."""

from hostswap.schedules.floor import Floor, compute_floor
from hostswap.schedules.serialization import load_weight_schedule, load_weight_schedules
from hostswap.schedules.weight_schedule import ScheduleError, WeightSchedule, load_floor_bytes

__all__ = ["Floor", "ScheduleError", "WeightSchedule", "compute_floor", "load_floor_bytes", "load_weight_schedule", "load_weight_schedules"]
