"""The simulator: one training iteration of a plan, timed by a cost model.

engine    `simulate`, `Report`: the event model (async or lock-step)
timeline  Perfetto (Chrome trace event) files and Gantt charts
bounds    `iteration_floor`: no plan of a graph simulates faster
"""

from graphpipe.simulator.bounds import Floor, iteration_floor
from graphpipe.simulator.engine import Report, simulate

__all__ = ["Floor", "Report", "iteration_floor", "simulate"]
