"""The GraphPipe evaluation of PAPERS.md, simulated, in one command.

  python -m experiments.reproduce --out=DIR

Every configuration is planned by each planner and simulated under the V100
analytic cost model (the paper's Summit nodes: 4 V100s, NVLink, InfiniBand
between nodes), at the zoo's paper configs and batch sizes
(`graphpipe.models.default_batch_size`: 4-GPU-node batches scaled with the
devices). Figures, each a key of DIR/results.json, a PNG and a table of
DIR/REPRODUCTION.md beside the paper's numbers:

  throughput    samples/s against devices (4-32) for mmt, dlrm and
                candle_uno with graphpipe, sequential and piper
  branch_sweep  CANDLE-Uno with 2, 4, 8 and 16 branches at 32 devices,
                the layer after the concatenation captured whole and in 2,
                4 and 8 parts (`graphpipe.capture`'s split_layers): each
                planner's row is its fastest of them
  split_throughput  the candle_uno rows of `throughput` again, each
                planner at its fastest over the same splits
  ablation      at 32 devices, GraphPipe at the sequential plan's
                micro-batch size (concurrency only) and with its own, over
                sequential
  search_time   each planner's search time per model at 32 devices
  case_study    the two-branch transformer on 8 devices (batch 8), and the
                paper's two plans (8 stages of one block) in our cost model
  parity        the sequential transformer, graphpipe / sequential
  per_stage     GraphPipe with per-stage micro-batch sizes against one size,
                with the planner's padding trade and by time alone; and
                where memory binds (half and a quarter of the preset's)
  pipedream_check  PipeDream's published DP (`experiments.pipedream`)
                against `sequential` for mmt, candle_uno and transformer at
                4, 8 and 16 devices

The report's text is generated from the numbers
(`experiments.reproduction.report`), so it never goes stale. About 5 minutes on
the 2-core development machine.
"""

from __future__ import annotations

import dataclasses
import os
import time

from absl import app, flags

from experiments import common, pipedream
from experiments.reproduction import figures, paper, report, sizes
from graphpipe import capture, models, plan, simulate
from graphpipe.costs import AnalyticCostModel, device_spec
from graphpipe.errors import GraphpipeError, PlanError
from graphpipe.planning.arguments import searched_sizes
from graphpipe.planning.piper import PIPER_BUDGET
from graphpipe.planning.search import chunk_sizes
from graphpipe.simulator import iteration_floor

PLANNERS = ("graphpipe", "sequential", "piper")
BASELINES = ("sequential", "piper")
MODELS = ("mmt", "dlrm", "candle_uno")
# CANDLE-Uno's layer after the concatenation of its branches (1 GiB of
# weights at 16 branches): the one the branch sweep splits.
SPLIT_LAYER = "head.layers.0"


@dataclasses.dataclass
class Setup:
  """What every run of the reproduction shares.

  Attributes:
    config: zoo size, 'paper' (or 'tiny' for a smoke run).
    devices: device counts of the throughput figure.
    sweep_devices: the device count of the branch sweep, the ablation,
      the search times.
    branches: CANDLE-Uno branch counts of the sweep.
    split_parts: the parts the sweep cuts `SPLIT_LAYER` into (1: whole);
      every planner plans each and keeps its fastest.
    device: the device preset.
    piper_budget: stages Piper may price per search.
    memory_shares: shares of the preset's memory at which per-stage sizes
      are weighed again (`per_stage`'s `memory_rows`: where memory binds).
    graphs: captured graphs, by model name, (name, branches) or (name,
      branches, parts) with `SPLIT_LAYER` in parts; filled as the run
      captures them (tests pass synthetic ones).
  """

  config: str = "paper"
  devices: tuple[int, ...] = (4, 8, 16, 32)
  sweep_devices: int = 32
  branches: tuple[int, ...] = (2, 4, 8, 16)
  split_parts: tuple[int, ...] = (1, 2, 4, 8)
  device: str = "v100"
  piper_budget: int = PIPER_BUDGET
  memory_shares: tuple[float, ...] = (0.5, 0.25)
  graphs: dict = dataclasses.field(default_factory=dict)

  def cost_model(self):
    return AnalyticCostModel(device_spec(self.device))

  def graph(self, name: str, branches: int | None = None, parts: int = 1):
    """The graph of a zoo model (CANDLE-Uno with `branches` branches, its
    `SPLIT_LAYER` in `parts`)."""
    key = name if branches is None else (name, branches)
    if parts > 1:
      key = (name, branches, parts)
    split = {SPLIT_LAYER: parts} if parts > 1 else None
    if key not in self.graphs:
      start = time.perf_counter()
      if branches is None:
        self.graphs[key] = models.capture_zoo(
          name, self.config, split_layers=split
        )
      else:
        spec = models.get(name)
        cfg = dataclasses.replace(
          models.config(name, self.config), num_branches=branches
        )
        self.graphs[key] = capture(
          spec.loss_fn,
          models.build(name, cfg, abstract=True),
          spec.abstract_batch(cfg, 8),
          granularity=spec.capture_depth,
          split_layers=split,
          name=name,
          config=f"{self.config}, {branches} branches"
          + (f", {SPLIT_LAYER} in {parts} parts" if parts > 1 else ""),
        )
      common.log(
        f"captured {key}: {len(self.graphs[key].nodes)} nodes in "
        f"{time.perf_counter() - start:.1f} s"
      )
    return self.graphs[key]


def run_planner(
  setup: Setup, graph, name: str, devices: int, planner: str, **options
) -> dict:
  """Plans and simulates one configuration; a row of the results."""
  batch = models.default_batch_size(name, devices)
  row = {
    "model": name,
    "num_devices": devices,
    "planner": planner,
    "batch_size": batch,
  }
  # The model traced at every size the search may ask about first: the
  # search assumes sizes trace and traces the ones it chooses, so a row
  # would otherwise time the traces the sweep's earlier rows left undone
  # (about a second each at paper size), not the search.
  for size in chunk_sizes(searched_sizes(batch, None), devices):
    graph.traces_at(size)
  start = time.perf_counter()
  try:
    p = plan(
      graph,
      devices,
      batch,
      planner=planner,
      device=setup.device,
      piper_budget=setup.piper_budget,
      **options,
    )
  except PlanError as err:
    row.update(error=str(err), search_time_s=time.perf_counter() - start)
    return row
  simulated = simulate(p, graph, setup.cost_model())
  row.update(common.plan_summary(p, simulated))
  row["micro_batch_sizes"] = list(p.micro_batch_sizes)
  row["devices_per_stage"] = [len(s.devices) for s in p.stages]
  row["plan"] = p
  return row


def _public(rows: list[dict]) -> list[dict]:
  return [{k: v for k, v in r.items() if k != "plan"} for r in rows]


def speedups(rows: list[dict], key: str) -> list[dict]:
  """Per `key` value: graphpipe over sequential and over the best baseline."""
  by = {}
  for r in rows:
    if "error" not in r:
      by.setdefault(r[key], {})[r["planner"]] = r["throughput_samples_per_s"]
  out = []
  for value, speeds in by.items():
    base = {b: speeds[b] for b in BASELINES if b in speeds}
    best = max(base, key=base.get) if base else None
    ours = speeds.get("graphpipe")
    out.append(
      {
        key: value,
        "throughput": speeds,
        "best_baseline": best,
        "graphpipe_over_best_baseline": ours / base[best]
        if ours and best
        else None,
        "graphpipe_over_sequential": ours / speeds["sequential"]
        if ours and "sequential" in speeds
        else None,
      }
    )
  return out


def throughput(setup: Setup, progress) -> dict:
  rows = []
  for name in MODELS:
    graph = setup.graph(name)
    for devices in setup.devices:
      for planner in PLANNERS:
        rows.append(run_planner(setup, graph, name, devices, planner))
        progress.step(note(rows[-1]))
  out = {"rows": rows, "speedup": []}
  for name in MODELS:
    for entry in speedups(
      [r for r in rows if r["model"] == name], "num_devices"
    ):
      out["speedup"].append({"model": name, **entry})
  return out


def sweep_throughput(setup: Setup, through: dict, progress) -> dict:
  """The throughput runs at the sweep's device count (the ablation and the
  search times read them): `through` where the figure has that count, else
  run there (`--sweep_devices` need not be one of `--devices`)."""
  if setup.sweep_devices in setup.devices:
    return through
  return throughput(
    dataclasses.replace(setup, devices=(setup.sweep_devices,)), progress
  )


def best_over_splits(
  setup: Setup, branches, devices: int, planner: str, progress, whole=None
) -> tuple[dict, list[dict]]:
  """`planner`'s fastest CANDLE-Uno plan (`branches` branches, None: the
  config's) over `SPLIT_LAYER` whole and in `setup.split_parts` parts;
  `whole` is the unsplit row where it was run already. Returns (that
  row, with its split_parts; every option's throughput)."""
  best, tried = None, []
  for parts in setup.split_parts:
    if parts == 1 and whole is not None:
      row = dict(whole)
    else:
      graph = setup.graph("candle_uno", branches, parts)
      row = run_planner(setup, graph, "candle_uno", devices, planner)
      where = f"{branches} branches, " if branches else ""
      progress.step(f"{where}{parts} parts: " + note(row))
    row["split_parts"] = parts
    tried.append(
      {
        "num_devices": devices,
        "planner": planner,
        "split_parts": parts,
        "throughput_samples_per_s": row.get("throughput_samples_per_s"),
      }
    )
    if best is None or _faster(row, best):
      best = row
  return best, tried


def branch_sweep(setup: Setup, progress) -> dict:
  """Each planner at each branch count: its fastest plan over the graphs
  with `SPLIT_LAYER` whole or in `split_parts` (the same options for
  every planner)."""
  rows, tried = [], []
  for branches in setup.branches:
    for planner in PLANNERS:
      best, options = best_over_splits(
        setup, branches, setup.sweep_devices, planner, progress
      )
      best["branches"] = branches
      rows.append(best)
      tried += [t | {"branches": branches} for t in options]
  return {
    "rows": rows,
    "speedup": speedups(rows, "branches"),
    "split_layer": SPLIT_LAYER,
    "split_parts": list(setup.split_parts),
    "tried": tried,
    # The iteration no plan beats (over every split): the speed-up over
    # sequential it caps.
    "floor": {
      branches: min(
        (
          _floor(setup, setup.graph("candle_uno", branches, parts))
          | {"split_parts": parts}
          for parts in setup.split_parts
        ),
        key=lambda f: f["seconds"],
      )
      for branches in setup.branches
    },
  }


def split_throughput(setup: Setup, through: dict, progress) -> dict:
  """CANDLE-Uno's throughput figure again, each planner at its fastest
  over `SPLIT_LAYER` whole and in parts (the whole rows are `through`'s)."""
  rows, tried = [], []
  for devices in setup.devices:
    for planner in PLANNERS:
      whole = next(
        (
          r
          for r in through["rows"]
          if r["model"] == "candle_uno"
          and r["num_devices"] == devices
          and r["planner"] == planner
        ),
        None,
      )
      best, options = best_over_splits(
        setup, None, devices, planner, progress, whole
      )
      rows.append(best)
      tried += options
  return {
    "rows": rows,
    "speedup": speedups(rows, "num_devices"),
    "split_layer": SPLIT_LAYER,
    "split_parts": list(setup.split_parts),
    "tried": tried,
  }


def _faster(row: dict, than: dict) -> bool:
  """Whether `row` found a plan faster than `than`'s (a plan beats none)."""
  if "error" in row:
    return False
  if "error" in than:
    return True
  return row["throughput_samples_per_s"] > than["throughput_samples_per_s"]


def _floor(setup: Setup, graph) -> dict:
  """`iteration_floor` of the sweep's graph, and its node's weight bytes."""
  floor = iteration_floor(
    graph,
    models.default_batch_size("candle_uno", setup.sweep_devices),
    setup.sweep_devices,
    setup.cost_model(),
  )
  node = next(n for n in graph.nodes if n.name == floor.node)
  return dataclasses.asdict(floor) | {"param_bytes": node.param_bytes}


def ablation(setup: Setup, through: dict, progress) -> dict:
  """GraphPipe at sequential's micro-batch size (concurrency only)."""
  out = []
  for name in MODELS:
    found = {
      r["planner"]: r
      for r in through["rows"]
      if r["model"] == name and r["num_devices"] == setup.sweep_devices
    }
    seq, ours = found.get("sequential"), found.get("graphpipe")
    if not seq or "error" in seq or not ours or "error" in ours:
      continue
    only = run_planner(
      setup,
      setup.graph(name),
      name,
      setup.sweep_devices,
      "graphpipe",
      micro_batch_sizes=[seq["micro_batch_size"]],
    )
    progress.step(f"{name} concurrency only: " + note(only))
    base = seq["throughput_samples_per_s"]
    out.append(
      {
        "model": name,
        "num_devices": setup.sweep_devices,
        "sequential_micro_batch_size": seq["micro_batch_size"],
        "graphpipe_micro_batch_size": ours["micro_batch_size"],
        # None where the search at that size finds no plan.
        "concurrency_only": only["throughput_samples_per_s"] / base
        if "error" not in only
        else None,
        "concurrency_and_micro_batch": ours["throughput_samples_per_s"] / base,
        "concurrency_only_depth": only.get("depth"),
        "sequential_depth": seq["depth"],
      }
    )
  return {"rows": out}


def search_time(setup: Setup, through: dict) -> dict:
  rows = [
    {
      "model": r["model"],
      "planner": r["planner"],
      "search_time_s": r["search_time_s"],
      "found_plan": "error" not in r,
    }
    for r in through["rows"]
    if r["num_devices"] == setup.sweep_devices
  ]
  return {"num_devices": setup.sweep_devices, "rows": rows}


def case_study(setup: Setup, progress) -> dict:
  """The two-branch transformer on 8 devices, and the paper's plans."""
  graph = setup.graph("two_branch")
  rows = []
  for planner in PLANNERS:
    rows.append(run_planner(setup, graph, "two_branch", 8, planner))
    progress.step("case study: " + note(rows[-1]))
  plans = paper.case_study_plans(graph)
  model = setup.cost_model()
  timed = {
    kind: {
      "depth": p.depth,
      "num_stages": p.num_stages,
      "micro_batch_size": p.micro_batch_size,
      "micro_batches": p.batch_size // p.micro_batch_size,
      # The whole model's forward and backward per sample, one device.
      "per_sample_s": sum(
        model.node_time(n, p.micro_batch_size, part)
        for n in graph.nodes
        for part in ("fwd", "bwd")
      )
      / p.micro_batch_size,
      "throughput_samples_per_s": simulate(
        p, graph, model
      ).throughput_samples_per_s,
    }
    for kind, p in plans.items()
  }
  return {
    "rows": rows,
    "speedup": speedups(rows, "model"),
    "paper_plans": timed,
  }


def parity(setup: Setup, progress) -> dict:
  graph = setup.graph("transformer")
  rows = []
  for devices in setup.devices:
    for planner in PLANNERS:
      rows.append(run_planner(setup, graph, "transformer", devices, planner))
      progress.step("parity: " + note(rows[-1]))
  return {"rows": rows, "speedup": speedups(rows, "num_devices")}


def note(row: dict) -> str:
  """One configuration's row in a progress line."""
  head = f"{row['model']} {row['num_devices']} {row['planner']}"
  if "error" in row:
    return f"{head}: no plan ({row['search_time_s']:.1f} s)"
  return (
    f"{head}: {row['throughput_samples_per_s']:.4g} samples/s, "
    f"{row['num_stages']} stages, depth {row['depth']}, "
    f"b={row['micro_batch_size']}, search {row['search_time_s']:.1f} s"
  )


def run(setup: Setup, out: str, plots: bool = True) -> dict:
  """Every figure (module docstring); writes DIR's files; the results."""
  start = time.perf_counter()
  steps = (
    len(MODELS) * len(setup.devices) * (len(PLANNERS) + 1)
    + len(setup.branches) * len(PLANNERS) * len(setup.split_parts)
    + len(setup.devices)
    * len(PLANNERS)
    * len([p for p in setup.split_parts if p > 1])
    + len(MODELS)
    + len(PLANNERS) * (1 + len(setup.devices))
    + 3 * len([d for d in setup.devices if d <= 16])
    + len(MODELS) * len(setup.devices)
    + len(MODELS) * len(setup.memory_shares)
  )
  # The ablation and the search times read the throughput runs at the
  # sweep's device count: run there too where the figure leaves it out.
  apart = setup.sweep_devices not in setup.devices
  steps += len(MODELS) * len(PLANNERS) * apart
  progress = common.Progress(steps, "configuration")
  through = throughput(setup, progress)
  at_sweep = sweep_throughput(setup, through, progress)
  results = {"throughput": through}
  results["branch_sweep"] = branch_sweep(setup, progress)
  results["split_throughput"] = split_throughput(setup, through, progress)
  results["ablation"] = ablation(setup, at_sweep, progress)
  results["search_time"] = search_time(setup, at_sweep)
  results["case_study"] = case_study(setup, progress)
  results["parity"] = parity(setup, progress)
  results["per_stage"] = sizes.per_stage(
    setup, MODELS, through, progress, run_planner, note
  )
  results["pipedream_check"] = pipedream.reproduce_rows(
    setup, through, results["parity"], progress
  )
  for key in (
    "throughput",
    "branch_sweep",
    "split_throughput",
    "case_study",
    "parity",
  ):
    results[key]["rows"] = _public(results[key]["rows"])
  results["paper"] = paper.PAPER
  results["config"] = {
    "config": setup.config,
    "devices": list(setup.devices),
    "sweep_devices": setup.sweep_devices,
    "branches": list(setup.branches),
    "split_parts": list(setup.split_parts),
    "device": setup.device,
    "piper_budget": setup.piper_budget,
    "memory_shares": list(setup.memory_shares),
    "batch_size": "graphpipe.models.default_batch_size",
  }
  results["run_time_s"] = time.perf_counter() - start
  os.makedirs(out, exist_ok=True)
  results["figures"] = figures.draw(results, out) if plots else []
  with open(os.path.join(out, "REPRODUCTION.md"), "w") as f:
    f.write(report.markdown(results))
  common.write_results(out, results)
  return results


def define_flags() -> None:
  """This experiment's flags (defined when run, so tests import freely)."""
  common.define_flags()
  common.define_out()
  flags.DEFINE_enum("config", "paper", models.SIZES, "Zoo model size.")
  flags.DEFINE_list("devices", ["4", "8", "16", "32"], "Device counts.")
  flags.DEFINE_integer(
    "sweep_devices",
    32,
    "Devices of the branch sweep, ablation, search time.",
    lower_bound=1,
  )
  flags.DEFINE_list("branches", ["2", "4", "8", "16"], "CANDLE-Uno branches.")
  flags.DEFINE_list(
    "split_parts",
    ["1", "2", "4", "8"],
    f"Parts the branch sweep cuts CANDLE-Uno's {SPLIT_LAYER} into (1: "
    "whole); each planner keeps its fastest.",
  )
  from graphpipe.costs.analytic import PRESETS

  flags.DEFINE_enum("device", "v100", PRESETS, "Device preset.")
  common.define_piper_budget()
  common.check_int_list("devices")
  common.check_int_list("branches")
  common.check_int_list("split_parts")
  flags.DEFINE_bool("plots", True, "Draw the PNGs (needs matplotlib).")


def main(argv):
  common.start(argv)
  options = flags.FLAGS
  try:
    setup = Setup(
      config=options.config,
      devices=tuple(int(d) for d in options.devices),
      sweep_devices=options.sweep_devices,
      branches=tuple(int(b) for b in options.branches),
      split_parts=tuple(int(p) for p in options.split_parts),
      device=options.device,
      piper_budget=options.piper_budget,
    )
  except ValueError as err:
    raise app.UsageError(
      f"--devices, --branches and --split_parts take integers: {err}"
    ) from err
  try:
    results = run(setup, options.out, options.plots)
  except GraphpipeError as err:
    raise SystemExit(f"experiments.reproduce: {err}") from err
  print(report.summary(results))
  print(
    f"wrote {options.out}/results.json and REPRODUCTION.md in "
    f"{results['run_time_s'] / 60:.1f} min"
  )


if __name__ == "__main__":
  define_flags()
  app.run(main)
