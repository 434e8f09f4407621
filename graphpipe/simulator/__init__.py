"""The simulator: one training iteration of a plan, timed by a cost model.

engine    `simulate`, `Report`: the event model (async or lock-step)
timeline  Perfetto (Chrome trace event) files and Gantt charts
"""

from graphpipe.simulator.engine import Report, simulate

__all__ = ["Report", "simulate"]
