"""Plan, schedule and simulate one zoo model on N devices.

  python -m experiments.plan --model=mmt --config=paper --num_devices=8 \\
    --planner=graphpipe --device=v100 --out=/tmp/mmt8

writes to DIR:
  plan.json      the stage DAG (`graphpipe.Plan.save`)
  schedule.json  per device its ordered actions and their ticks
  trace.json     the simulated iteration; open it in https://ui.perfetto.dev
  schedule.png   the same timeline as a Gantt chart (needs matplotlib)
  results.json   planner, num_devices, num_stages, depth, micro_batch_size,
                 num_microbatches, iteration_time_s, throughput_samples_per_s,
                 peak_memory_bytes (max over devices), bubble_fraction,
                 search_time_s, memory_per_device (per device, bytes by
                 kind: parameters, gradients, optimizer, state, stashes,
                 channels, batch, work; from the runtime's own layout),
                 padding_fraction (parameter and optimizer bytes held
                 beyond each device's own stage / all held), the
                 planner's bound beside them, iteration_floor_s and
                 iteration_floor_node (no plan on these devices simulates
                 faster: `graphpipe.simulator.iteration_floor`; analytic
                 costs only), runtime_iteration_time_s (the same plan as
                 `graphpipe.runtime` steps it: tick by tick, every
                 backward adding slot-sized gradients; `simulate(...,
                 lockstep=True)`), plus the config and the environment.

Default batch size (our choice; PAPERS.md has no table): the zoo's
`default_batch_size` is the mini-batch of one 4-GPU Summit node, and larger
runs scale it with the device count as the paper's 4 to 32 GPU sweep does
(weak scaling): B = default x max(N, 4) / 4
(`graphpipe.models.default_batch_size`). The two-branch case study is one
fixed configuration (8 devices, B = 8, derived in graphpipe.models from the
paper's own attribution of the gain).
"""

import json
import os
import time

import optax
from absl import app, flags

from experiments import common
from graphpipe import (
  PLANNERS,
  memory_report,
  models,
  plan_and_simulate,
  simulate,
)
from graphpipe.core.memory import plan_memory
from graphpipe.costs import AnalyticCostModel, device_spec
from graphpipe.errors import (
  GraphpipeError,
  PipelineRuntimeError,
  PlotsUnavailableError,
)
from graphpipe.planning import engine
from graphpipe.planning.piper import PIPER_BUDGET
from graphpipe.simulator import iteration_floor


def run(
  *,
  model: str,
  config: str,
  num_devices: int,
  batch_size: int | None,
  planner: str,
  device: str,
  out: str,
  plots: bool = True,
  profiled: bool = False,
  padding_tolerance: float | None = None,
  max_padding: float | None = None,
  piper_budget: int = PIPER_BUDGET,
  stage_shardings: tuple[str, ...] = ("replicated",),
  split_layers: dict[str, int] | None = None,
  lockstep: bool = False,
) -> dict:
  """Captures, plans, schedules and simulates; writes DIR's files.

  Example:
    >>> results = run(model="two_branch", config="tiny", num_devices=8,
    ...               batch_size=None, planner="graphpipe", device="v100",
    ...               out="/tmp/tb")

  Args:
    model, config: the zoo model and its size ('paper' or 'tiny').
    num_devices: devices the plan may use.
    batch_size: samples per iteration; None: `default_batch_size`.
    planner: one of `graphpipe.PLANNERS` ('graphpipe', 'sequential',
      'gpipe', 'piper').
    device: a device preset ('v100', 'a100', 'h100', 'h200', 'cpu').
    out: the output folder (created).
    plots: draw schedule.png (skipped with a note without matplotlib).
    profiled: time the nodes on this machine's device.
    padding_tolerance: `graphpipe.plan`'s (None: its default, 0.015).
    max_padding: `graphpipe.plan`'s hard limit on the padding fraction
      (None: no limit).
    piper_budget: stages Piper may price before it gives up.
    stage_shardings: `graphpipe.plan`'s layouts a stage may take
      (('replicated', 'zero1'): stages on several devices shard their
      optimizer state, ZeRO-1).
    split_layers: layers captured in parts by output features, each part
      its own node (`graphpipe.capture`'s): {'head.layers.0': 4}.
    lockstep: `graphpipe.plan`'s: choose the plan by how the runtime
      steps it rather than by the paper's asynchronous pipeline.

  Returns:
    The dict written to results.json.
  """
  if planner not in PLANNERS:
    raise GraphpipeError(
      f"unknown planner {planner!r}: use one of {', '.join(PLANNERS)}"
    )
  device_spec(device)  # fail before the capture on a bad preset
  chosen = batch_size
  if chosen is None:
    chosen = models.default_batch_size(model, num_devices)
  common.log(f"[1/4] capturing {model} ({config})")
  start = time.perf_counter()
  graph = models.capture_zoo(model, config, split_layers=split_layers)
  capture_s = time.perf_counter() - start
  common.log(
    f"      {len(graph.nodes)} nodes, {len(graph.edges)} edges in "
    f"{capture_s:.1f} s"
  )
  common.log(
    f"[2/4] planning with {planner} on {num_devices} x {device}, batch {chosen}"
  )
  start = time.perf_counter()
  plan, schedule, report = plan_and_simulate(
    graph,
    num_devices=num_devices,
    batch_size=chosen,
    planner=planner,
    device=device,
    profiled=profiled,
    padding_tolerance=padding_tolerance,
    max_padding=max_padding,
    piper_budget=piper_budget,
    stage_shardings=stage_shardings,
    lockstep=lockstep,
  )
  common.log(f"{plan}\n[3/4] simulated: {report}")
  memory = memory_figures(plan, graph)
  common.log(
    f"      memory ({memory['memory_source']}): largest device "
    f"{max(memory['total_bytes_per_device']) / 2**30:.3g} GiB, padding "
    f"{memory['padding_fraction']:.1%} of parameter and optimizer bytes"
  )
  # No plan on these devices is faster (analytic costs only: the bound
  # needs times per sample that do not grow with the batch).
  floor = (
    None
    if profiled
    else iteration_floor(
      graph, chosen, num_devices, AnalyticCostModel(device_spec(device))
    )
  )
  if floor is not None:
    common.log(
      f"      floor: no plan is faster than {floor.seconds * 1e3:.4g} ms "
      f"(node {floor.node!r} alone); this plan is "
      f"{report.iteration_time_s / floor.seconds:.2f}x of it"
    )
  # As the runtime steps it: tick by tick, slot-sized gradient adds.
  runtime = simulate(plan, graph, lockstep=True).iteration_time_s
  common.log(
    f"      as graphpipe.runtime steps it: {runtime * 1e3:.4g} ms "
    f"({runtime / report.iteration_time_s:.2f}x)"
  )
  results = {
    **common.plan_summary(plan, report),
    "runtime_iteration_time_s": runtime,
    "iteration_floor_s": floor.seconds if floor else None,
    "iteration_floor_node": floor.node if floor else None,
    "model": model,
    "config": {
      "model": model,
      "config": config,
      "num_devices": num_devices,
      "batch_size": chosen,
      "batch_size_source": "default" if batch_size is None else "flag",
      "planner": planner,
      "device": device,
      "cost_model": "profiled" if profiled else "analytic",
      "padding_tolerance": padding_tolerance,
      "max_padding": max_padding,
      "piper_budget": piper_budget,
      "lockstep": lockstep,
    },
    "in_flight": list(schedule.in_flight),
    "peak_stash": list(report.peak_stash),
    "peak_memory_bytes_per_device": list(report.peak_memory_bytes),
    **memory,
    "capture_time_s": capture_s,
    "plan_and_simulate_time_s": time.perf_counter() - start,
  }
  os.makedirs(out, exist_ok=True)
  plan.save(os.path.join(out, "plan.json"))
  with open(os.path.join(out, "schedule.json"), "w") as f:
    json.dump(schedule.to_dict(), f)
  report.save_trace(os.path.join(out, "trace.json"))
  written = ["plan.json", "schedule.json", "trace.json"]
  if plots:
    try:
      report.save_gantt(
        os.path.join(out, "schedule.png"),
        title=(
          f"{model} ({config}), {planner}, {num_devices} x {device}: "
          f"{report.throughput_samples_per_s:.4g} samples/s, bubble "
          f"{report.bubble_fraction:.0%}"
        ),
      )
      written.append("schedule.png")
    except PlotsUnavailableError as err:
      common.log(f"      no schedule.png: {err}")
  common.write_results(out, results)
  written.append("results.json")
  common.log(f"[4/4] wrote {', '.join(written)} to {out}")
  return results


def memory_figures(plan, graph) -> dict:
  """What each device will hold (by kind) and the padding among it.

  From the runtime's own layout (`graphpipe.memory_report`, Adam, abstract
  values only) where the runtime can run the plan, else the planner's
  bound (`graphpipe.core.memory.plan_memory`); both beside each other.
  """
  planner = plan_memory(graph, plan)
  try:
    report = memory_report(plan, graph, optax.adam(1e-3))
  except PipelineRuntimeError as err:
    common.log(f"      no runtime memory report ({err}): the planner's bound")
    report = planner
  out = {
    "memory_source": report.source,
    "memory_per_device": [dict(k) for k in report.per_device],
    "total_bytes_per_device": list(report.totals),
    "padding_fraction": report.padding_fraction,
    "padding_bytes_per_device": list(report.padding_bytes),
    "param_optimizer_bytes_own": list(report.own_bytes),
    "param_optimizer_bytes_held": list(report.held_bytes),
    "planner_memory_per_device": [dict(k) for k in planner.per_device],
    "planner_padding_fraction": planner.padding_fraction,
  }
  return out


def define_flags() -> None:
  """This experiment's flags (defined when run, so tests import freely)."""
  common.define_flags()
  from graphpipe import PLANNERS
  from graphpipe.costs.analytic import PRESETS

  flags.DEFINE_enum("model", "two_branch", models.NAMES, "Zoo model.")
  flags.DEFINE_enum("config", "tiny", models.SIZES, "Model size.")
  flags.DEFINE_integer(
    "num_devices", 8, "Devices the plan may use.", lower_bound=1
  )
  flags.DEFINE_integer(
    "batch_size",
    None,
    "Samples per iteration; default: the zoo default x max(N, 4) / 4.",
    lower_bound=1,
  )
  flags.DEFINE_enum("planner", "graphpipe", PLANNERS, "Planner.")
  flags.DEFINE_enum("device", "v100", PRESETS, "Device preset.")
  flags.DEFINE_bool("plots", True, "Draw schedule.png (needs matplotlib).")
  flags.DEFINE_bool(
    "profiled",
    False,
    "Time each node on this machine's device (cached under "
    "~/.cache/graphpipe) instead of the analytic estimate.",
  )
  flags.DEFINE_float(
    "padding_tolerance",
    None,
    "How much slower a less padded plan may be and still win (a share of "
    "the fastest plan's time); default the planner's "
    f"{engine.PADDING_TOLERANCE}, 0 = time alone.",
  )
  flags.DEFINE_float(
    "max_padding",
    None,
    "Only plans whose padding fraction (parameter and optimizer bytes "
    "held beyond each device's own stage, a share of all held) is at most "
    "this; default no limit.",
  )
  flags.DEFINE_list(
    "stage_shardings",
    ["replicated"],
    "Layouts a stage may take: replicated, or replicated,zero1 (stages on "
    "several devices shard their optimizer state, ZeRO-1).",
  )
  flags.DEFINE_bool(
    "lockstep",
    False,
    "Choose the plan by how graphpipe.runtime steps it (tick by tick, "
    "slot-sized gradient adds) rather than by the paper's asynchronous "
    "pipeline.",
  )
  flags.DEFINE_list(
    "split_layers",
    [],
    "Layers to capture in parts by output features, each part its own "
    "node (tensor parallelism as branches): name:parts,... e.g. "
    "head.layers.0:4.",
  )
  flags.register_validator(
    "split_layers",
    _valid_split_layers,
    message="--split_layers takes name:parts items with parts >= 2 "
    "(head.layers.0:4)",
  )
  common.define_piper_budget()
  common.define_out()


def _valid_split_layers(items) -> bool:
  try:
    return all(parts >= 2 for parts in parse_split_layers(items).values())
  except GraphpipeError:
    return False


def parse_split_layers(items) -> dict[str, int]:
  """['head.layers.0:4', ...] -> {'head.layers.0': 4}."""
  out = {}
  for item in items:
    name, _, parts = str(item).rpartition(":")
    if not name or not parts.isdigit():
      raise GraphpipeError(
        f"--split_layers takes name:parts items (head.layers.0:4), got {item!r}"
      )
    out[name] = int(parts)
  return out


def main(argv):
  common.start(argv)
  options = flags.FLAGS
  try:
    run(
      model=options.model,
      config=options.config,
      num_devices=options.num_devices,
      batch_size=options.batch_size,
      planner=options.planner,
      device=options.device,
      out=options.out,
      plots=options.plots,
      profiled=options.profiled,
      padding_tolerance=options.padding_tolerance,
      max_padding=options.max_padding,
      piper_budget=options.piper_budget,
      stage_shardings=tuple(options.stage_shardings),
      lockstep=options.lockstep,
      split_layers=parse_split_layers(options.split_layers),
    )
  except GraphpipeError as err:
    raise SystemExit(f"experiments.plan: {err}") from err


if __name__ == "__main__":
  define_flags()
  app.run(main)
