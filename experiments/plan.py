"""Plan, schedule and simulate one zoo model on N devices.

  python -m experiments.plan --model=mmt --config=paper --num_devices=8 \\
    --planner=graphpipe --device=v100 --out=/tmp/mmt8

writes to DIR:
  plan.json      the stage DAG (`graphpipe.plan.Plan.save`)
  schedule.json  per device its ordered actions and their ticks
  trace.json     the simulated iteration; open it in https://ui.perfetto.dev
  schedule.png   the same timeline as a Gantt chart (needs matplotlib)
  results.json   planner, num_devices, num_stages, depth, micro_batch_size,
                 num_microbatches, iteration_time_s, throughput_samples_per_s,
                 peak_memory_bytes (max over devices), bubble_fraction,
                 search_time_s, plus the config and the environment.

Default batch size (our choice; PAPERS.md has no table): the zoo's
`default_batch_size` is the mini-batch of one 4-GPU Summit node, and larger
runs scale it with the device count as the paper's 4 to 32 GPU sweep does
(weak scaling): B = default x max(N, 4) / 4. The two-branch case study is
one fixed configuration (8 devices, B = 8, derived in graphpipe.models from
the paper's own attribution of the gain).
"""

import datetime
import json
import os
import platform
import subprocess
import sys
import time

from absl import app, flags

from graphpipe import models
from graphpipe.errors import GraphpipeError
from graphpipe.graph import OpGraph
from graphpipe.models import capture_zoo
from graphpipe.plan import Plan
from graphpipe.schedule import Schedule, schedule_for
from graphpipe.simulate import Report, simulate
from graphpipe.trace import PlotsUnavailableError

PLANNERS = ("graphpipe", "sequential", "gpipe")
NODE_SIZE = 4  # devices per Summit node, the unit the default batch scales by


def default_batch_size(model: str, num_devices: int) -> int:
  """The mini-batch used when none is given (see the module docstring).

  Example:
    >>> default_batch_size("mmt", 16)      # zoo default 64 per 4 devices
    256

  Args:
    model: a zoo model name.
    num_devices: devices the plan may use.
  """
  spec = models.get(model)
  if not spec.scale_batch:  # the case study: one fixed configuration
    return spec.default_batch_size
  return spec.default_batch_size * max(num_devices, NODE_SIZE) // NODE_SIZE


def environment() -> dict:
  """Facts about the machine and software that produced a result."""
  import jax
  import numpy

  try:
    commit = subprocess.run(
      ["git", "rev-parse", "--short", "HEAD"],
      capture_output=True,
      text=True,
      check=True,
      timeout=10,
    ).stdout.strip()
  except (OSError, subprocess.SubprocessError):
    commit = None
  return {
    "python": sys.version.split()[0],
    "platform": platform.platform(),
    "cpu_count": os.cpu_count(),
    "jax": jax.__version__,
    "numpy": numpy.__version__,
    "git_commit": commit,
    "time_utc": datetime.datetime.now(datetime.UTC).isoformat(),
  }


def plan_and_simulate(
  graph: OpGraph,
  *,
  num_devices: int,
  batch_size: int,
  planner: str,
  device: str,
  profiled: bool = False,
) -> tuple[Plan, Schedule, Report]:
  """Plans `graph`, builds the plan's schedule and simulates one iteration.

  Example:
    >>> plan, schedule, report = plan_and_simulate(
    ...   graph, num_devices=8, batch_size=128, planner="graphpipe",
    ...   device="v100")

  Args:
    graph: the captured model.
    num_devices: devices the plan may use.
    batch_size: samples per iteration.
    planner: 'graphpipe', 'sequential' or 'gpipe'.
    device: a device preset of `graphpipe.costs` ('v100', 'a100', ...).
    profiled: time every node on this machine's device (cached on disk)
      instead of the analytic estimate; the preset still gives links,
      memory and the optimizer. Meaningful when the preset describes the
      device at hand (e.g. 'cpu' here, 'h200' on an H200).
  """
  from graphpipe import costs
  from graphpipe import planner as planners

  cost_model = costs.AnalyticCostModel(costs.device_spec(device))
  if profiled:
    cost_model = costs.ProfiledCostModel(graph, cost_model)
  plan = planners.plan(
    graph,
    num_devices,
    batch_size,
    planner=planner,
    device=device,
    cost_model=cost_model,
  )
  schedule = schedule_for(plan)
  return plan, schedule, simulate(plan, graph, cost_model, schedule)


def summary(plan: Plan, report: Report) -> dict:
  """The headline figures of one planned and simulated configuration."""
  return {
    "planner": plan.planner,
    "num_devices": plan.num_devices,
    "num_stages": plan.num_stages,
    "depth": plan.depth,
    "batch_size": plan.batch_size,
    "micro_batch_size": plan.micro_batch_size,
    "num_microbatches": plan.num_microbatches,
    "schedule": report.schedule_kind,
    "iteration_time_s": report.iteration_time_s,
    "throughput_samples_per_s": report.throughput_samples_per_s,
    "peak_memory_bytes": report.max_peak_memory_bytes,
    "memory_capacity_bytes": report.memory_capacity_bytes,
    "fits_memory": report.fits_memory,
    "bubble_fraction": report.bubble_fraction,
    "search_time_s": plan.search_time_s,
    "bottleneck_time_per_sample": plan.bottleneck_time_per_sample,
  }


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
    planner: 'graphpipe', 'sequential' or 'gpipe'.
    device: a device preset ('v100', 'a100', 'h100', 'h200', 'cpu').
    out: the output folder (created).
    plots: draw schedule.png (skipped with a note without matplotlib).

  Returns:
    The dict written to results.json.
  """
  from graphpipe import costs

  if planner not in PLANNERS:
    raise GraphpipeError(
      f"unknown planner {planner!r}: use one of {', '.join(PLANNERS)}"
    )
  costs.device_spec(device)  # fail before the capture on a bad preset
  chosen = batch_size or default_batch_size(model, num_devices)
  _progress(f"[1/4] capturing {model} ({config})")
  start = time.perf_counter()
  graph = capture_zoo(model, config)
  capture_s = time.perf_counter() - start
  _progress(
    f"      {len(graph.nodes)} nodes, {len(graph.edges)} edges in "
    f"{capture_s:.1f} s"
  )
  _progress(
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
  )
  _progress(f"{plan}\n[3/4] simulated: {report}")
  results = {
    **summary(plan, report),
    "model": model,
    "config": {
      "model": model,
      "config": config,
      "num_devices": num_devices,
      "batch_size": chosen,
      "batch_size_source": "flag" if batch_size else "default",
      "planner": planner,
      "device": device,
      "cost_model": "profiled" if profiled else "analytic",
    },
    "in_flight": list(schedule.in_flight),
    "peak_stash": list(report.peak_stash),
    "peak_memory_bytes_per_device": list(report.peak_memory_bytes),
    "capture_time_s": capture_s,
    "plan_and_simulate_time_s": time.perf_counter() - start,
    "environment": environment(),
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
      _progress(f"      no schedule.png: {err}")
  with open(os.path.join(out, "results.json"), "w") as f:
    json.dump(results, f, indent=1)
  written.append("results.json")
  _progress(f"[4/4] wrote {', '.join(written)} to {out}")
  return results


def _progress(text: str) -> None:
  print(text, flush=True)


def _define_flags() -> None:
  """This experiment's flags (defined when run, so helpers import freely)."""
  flags.DEFINE_string(
    "model",
    "two_branch",
    "Zoo model: " + ", ".join(models.NAMES) + ".",
  )
  flags.DEFINE_string("config", "tiny", "Model size: paper or tiny.")
  flags.DEFINE_integer("num_devices", 8, "Devices the plan may use.")
  flags.DEFINE_integer(
    "batch_size",
    None,
    "Samples per iteration; default: the zoo default x max(N, 4) / 4.",
  )
  flags.DEFINE_string("planner", "graphpipe", "graphpipe, sequential, gpipe.")
  flags.DEFINE_string(
    "device", "v100", "Device preset: v100, a100, h100, h200, cpu."
  )
  flags.DEFINE_bool("plots", True, "Draw schedule.png (needs matplotlib).")
  flags.DEFINE_bool(
    "profiled",
    False,
    "Time each node on this machine's device (cached under "
    "~/.cache/graphpipe) instead of the analytic estimate.",
  )
  flags.DEFINE_string("out", None, "Output folder.", required=True)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
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
    )
  except GraphpipeError as err:
    raise SystemExit(f"experiments.plan: {err}") from err


if __name__ == "__main__":
  _define_flags()
  app.run(main)
