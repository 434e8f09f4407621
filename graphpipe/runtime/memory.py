"""`memory_report`: what every device of a plan's step will hold.

Computed before anything is allocated, from the layout and the buffers the
runtime itself builds (`build_layout`, `StepBuilder`: stage programs and
residuals traced on abstract values), so it works on paper-size models
captured from `nnx.eval_shape`. The bytes by kind come from the same rule
as the planner's (`graphpipe.core.memory.device_bytes`); the planner sizes
the same buffers from the graph's figures, never below these.

Example:
  >>> graph = capture_zoo("two_branch", "tiny")
  >>> p = graphpipe.plan(graph, num_devices=2, batch_size=8)
  >>> report = graphpipe.memory_report(p, graph, optax.adam(1e-3))
  >>> kinds = report.per_device[0]
  >>> print(list(kinds))
  ['parameters', 'gradients', 'optimizer', 'state', 'stashes', 'channels',
   'batch', 'work', 'tables']
  >>> kinds["optimizer"] // kinds["parameters"]   # Adam: two moments
  2
"""

from __future__ import annotations

import time

import jax
import optax

from graphpipe.core.graph import OpGraph
from graphpipe.core.memory import (
  Holdings,
  MemoryReport,
  work_bytes,
)
from graphpipe.core.stages import Plan
from graphpipe.errors import PipelineRuntimeError
from graphpipe.runtime.buffers import Buffers
from graphpipe.runtime.guards import captured_graph
from graphpipe.runtime.layout import Layout, build_layout
from graphpipe.runtime.step import StepBuilder
from graphpipe.runtime.zero import ZeroOne
from graphpipe.schedules.builders import schedule_for
from graphpipe.schedules.checker import check_schedule


def memory_report(
  plan: Plan,
  graph: OpGraph | None = None,
  optimizer: optax.GradientTransformation | None = None,
  *,
  schedule=None,
  recompute: bool = False,
) -> MemoryReport:
  """Per device, the bytes the runtime will hold for `plan`, by kind.

  Args:
    plan: the plan to run.
    graph: the captured graph (default `plan.graph`); an abstract capture
      (from `nnx.eval_shape`) is enough.
    optimizer: the optax transformation the trainer will run (default
      Adam: two moments and a count).
    schedule: as for `graphpipe.Trainer` (default the plan's).
    recompute: as for `graphpipe.Trainer`.
  """
  if not isinstance(plan, Plan):
    raise PipelineRuntimeError(
      f"memory_report takes a Plan, got {type(plan).__name__}"
    )
  graph = captured_graph(plan, graph, "the memory report", "memory_report(plan")
  if optimizer is not None and not all(
    hasattr(optimizer, a) for a in ("init", "update")
  ):
    raise PipelineRuntimeError(
      f"optimizer must be an optax GradientTransformation (e.g. "
      f"optax.adam(1e-3)), got {optimizer!r}"
    )
  if schedule is None or isinstance(schedule, str):
    schedule = schedule_for(plan, schedule)
  check_schedule(schedule)
  # Sizes only: the made-up-values probe is the trainer's (it runs the
  # program, seconds on a paper-size model).
  layout = build_layout(graph, plan, schedule, probe=False)
  builder = StepBuilder(
    layout,
    schedule,
    graph.program,
    recompute=recompute,
    batch_size=plan.batch_size,
    inputs=graph.inputs,
  )
  return runtime_report(
    layout,
    builder.buffers,
    graph,
    optimizer or optax.adam(1e-3),
    builder.tables,
  )


def runtime_report(
  layout: Layout, buf: Buffers, graph: OpGraph, optimizer, tables: dict
) -> MemoryReport:
  """The `MemoryReport` of a built layout, its buffers and tick tables."""
  table_bytes = sum(t.nbytes for t in tables.values())
  zero = ZeroOne(layout, buf.params)
  owned = zero.owned
  # (slots, or with ZeRO-1 stages the owned vector)
  opt_state = jax.eval_shape(optimizer.init, zero.optimizer_input())
  optimizer_bytes = sum(
    x.size * x.dtype.itemsize for x in jax.tree.leaves(opt_state)
  )
  stage_of = [-1] * layout.num_devices
  own = [0] * layout.num_devices
  own_opt = [0] * layout.num_devices
  for s in layout.stages:
    for d in s.devices:
      stage_of[d], own[d] = s.id, layout.param_size(s.id)
      own_opt[d] = owned.needed[s.id]
  holdings = Holdings(
    param_elements=buf.params.total(),
    state_elements=buf.state.total(),
    optimizer_bytes=int(optimizer_bytes),
    stash_elements=buf.act_slot * buf.act_slots
    + buf.grad_slot * buf.grad_slots
    + buf.res_slot * buf.res_slots
    + 2 * buf.channel,
    channel_elements=buf.channel * buf.channels,
    batch_bytes=4 * buf.feed,
    work_bytes=max(work_bytes(graph, s.nodes, s.chunk) for s in layout.stages),
    table_bytes=table_bytes,
    replicas=max(len(s.devices) for s in layout.stages),
    own_param_elements=tuple(own),
    stages=tuple(stage_of),
    optimizer_elements=owned.length if owned.sharded else 0,
    own_optimizer_elements=tuple(own_opt),
  )
  return MemoryReport.from_holdings(holdings, "runtime")


def trainer_report(trainer, state=None, batch=None) -> dict:
  """`Trainer.memory_report`: the prediction for its own layout and
  buffers, and, given a state and a batch, the compiled step's figures."""
  layout, buffers = trainer.layout, trainer.buffers
  report = runtime_report(
    layout, buffers, trainer.graph, trainer.optimizer, trainer.builder.tables
  ).to_dict()
  owner = layout.stage_of_device()
  report["param_bytes_own"] = [
    4 * layout.param_size(owner[d]) if d in owner else 0
    for d in range(layout.num_devices)
  ]
  report["param_bytes_held"] = [4 * buffers.params.total()] * (
    layout.num_devices
  )
  report["stash_bytes"] = buffers.stash_bytes()
  if state is None or batch is None:
    return report
  start = time.perf_counter()
  compiled = trainer.compiled(state, batch)
  report["compile_time_s"] = time.perf_counter() - start
  mem = compiled.memory_analysis()
  report["compiled_bytes"] = None
  report["peak_memory_bytes"] = None
  if mem is not None:
    report["compiled_bytes"] = int(
      mem.argument_size_in_bytes
      + mem.output_size_in_bytes
      + mem.temp_size_in_bytes
      - mem.alias_size_in_bytes
    )
    report["peak_memory_bytes"] = int(
      getattr(mem, "peak_memory_in_bytes", 0) or report["compiled_bytes"]
    )
  return report
