"""GraphPipe against the sequential baselines, simulated (the paper's figure).

  python -m experiments.compare_planners \\
    --models=mmt,dlrm,candle_uno,transformer,two_branch \\
    --devices=4,8,16,32 --device=v100 --out=/tmp/compare

Captures each model once, then for every device count plans it with each
planner (graphpipe, sequential, gpipe; add piper with --planners),
schedules and simulates the plan under the device preset's analytic cost
model. Writes DIR/results.json (one
row per model x devices x planner with throughput, depth, micro-batch,
memory, bubble; per model x devices the graphpipe / sequential and
graphpipe / best-baseline throughput ratios; config and environment) and,
with matplotlib, DIR/ratio.png: the graphpipe / sequential ratio against the
device count, one line per model. The batch size of each configuration is
`graphpipe.models.default_batch_size`. A configuration that a planner cannot
plan (e.g. no plan fits memory) is recorded with its error and skipped.
"""

import os
import time

from absl import app, flags

from experiments import common
from graphpipe import PLANNERS, models, plan_and_simulate
from graphpipe.costs import device_spec
from graphpipe.errors import GraphpipeError
from graphpipe.planning.piper import PIPER_BUDGET

BASELINES = ("sequential", "gpipe", "piper")
# Piper's search is exponential in the branches (it gives up on DLRM and
# CANDLE-Uno after its budget): run it with --planners=...,piper.
DEFAULT_PLANNERS = ("graphpipe", "sequential", "gpipe")


def compare(
  *,
  model_names: list[str],
  device_counts: list[int],
  planners: list[str],
  device: str,
  config: str,
  piper_budget: int = PIPER_BUDGET,
) -> dict:
  """Plans and simulates every model x device count x planner.

  Example:
    >>> results = compare(model_names=["two_branch"], device_counts=[4, 8],
    ...                   planners=["graphpipe", "sequential"],
    ...                   device="v100", config="tiny")
    >>> results["ratios"][0]["graphpipe_over_sequential"]

  Args:
    model_names: zoo models.
    device_counts: device counts to plan for.
    planners: planners to compare ('graphpipe' first is usual).
    device: a device preset of `graphpipe.costs`.
    config: 'paper' or 'tiny'.
    piper_budget: stages Piper may price before it gives up.

  Returns:
    {'rows': [...], 'ratios': [...]} as written to results.json.
  """
  for name in model_names:
    models.get(name)
  for planner in planners:
    if planner not in PLANNERS:
      raise GraphpipeError(
        f"unknown planner {planner!r}: use any of {', '.join(PLANNERS)}"
      )
  device_spec(device)
  progress = common.Progress(
    len(model_names) * len(device_counts) * len(planners), "configuration"
  )
  rows = []
  for name in model_names:
    start = time.perf_counter()
    graph = models.capture_zoo(name, config)
    common.log(
      f"captured {name} ({config}): {len(graph.nodes)} nodes in "
      f"{time.perf_counter() - start:.1f} s"
    )
    for num_devices in device_counts:
      batch_size = models.default_batch_size(name, num_devices)
      for planner in planners:
        row = {
          "model": name,
          "num_devices": num_devices,
          "planner": planner,
          "batch_size": batch_size,
        }
        try:
          plan, _, report = plan_and_simulate(
            graph,
            num_devices=num_devices,
            batch_size=batch_size,
            planner=planner,
            device=device,
            piper_budget=piper_budget,
          )
          row.update(common.plan_summary(plan, report))
          note = (
            f"{report.throughput_samples_per_s:10.4g} samples/s, "
            f"{plan.num_stages} stages, depth {plan.depth}, "
            f"b={plan.micro_batch_size}"
          )
        except GraphpipeError as err:
          row["error"] = str(err)
          note = f"no plan: {err}"
        rows.append(row)
        progress.step(
          f"{name:<12} {num_devices:>3} devices {planner:<10} {note}"
        )
  return {"rows": rows, "ratios": ratios(rows)}


def ratios(rows: list[dict]) -> list[dict]:
  """Per model x devices, graphpipe's throughput over the baselines'.

  Example:
    >>> ratios(rows)[0]
    {'model': 'mmt', 'num_devices': 4, 'graphpipe_over_sequential': 1.2,
     'graphpipe_over_best_baseline': 1.2, ...}

  Args:
    rows: rows of `compare`; rows with an error count as missing.
  """
  table = {}
  for row in rows:
    if "error" not in row:
      key = (row["model"], row["num_devices"])
      table.setdefault(key, {})[row["planner"]] = row[
        "throughput_samples_per_s"
      ]
  out = []
  for (name, num_devices), speeds in table.items():
    entry = {"model": name, "num_devices": num_devices, "throughput": speeds}
    ours = speeds.get("graphpipe")
    base = speeds.get("sequential")
    entry["graphpipe_over_sequential"] = ours / base if ours and base else None
    best = max((speeds[b] for b in BASELINES if b in speeds), default=None)
    entry["graphpipe_over_best_baseline"] = (
      ours / best if ours and best else None
    )
    out.append(entry)
  return out


def plot_ratios(path: str, ratio_rows: list[dict], title: str) -> bool:
  """Draws graphpipe / sequential against devices; False without matplotlib.

  Example:
    >>> plot_ratios("ratio.png", results["ratios"], "v100")

  Args:
    path: the PNG to write.
    ratio_rows: `ratios(...)` output.
    title: the chart title.
  """
  try:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
  except ImportError:
    return False
  figure = Figure(figsize=(7, 4))
  FigureCanvasAgg(figure)
  axes = figure.add_subplot()
  names = sorted({r["model"] for r in ratio_rows})
  for name in names:
    points = sorted(
      (r["num_devices"], r["graphpipe_over_sequential"])
      for r in ratio_rows
      if r["model"] == name and r["graphpipe_over_sequential"] is not None
    )
    if points:
      axes.plot(*zip(*points, strict=True), marker="o", label=name)
  counts = sorted({r["num_devices"] for r in ratio_rows})
  axes.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
  axes.set_xscale("log", base=2)
  axes.set_xticks(counts, [str(c) for c in counts])
  axes.minorticks_off()
  axes.set_xlabel("devices")
  axes.set_ylabel("throughput, graphpipe / sequential")
  axes.set_title(title)
  axes.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
  figure.tight_layout()
  figure.savefig(path, dpi=120)
  return True


def write_plot(out: str, ratio_rows: list[dict], device: str) -> str:
  """Draws `out`/ratio.png where there is a ratio to draw; what it did.

  A model and device count has a ratio when both graphpipe and sequential
  planned it: where no configuration has both (one of them not among
  `--planners`, or no plan from it) there is nothing to draw, and no
  empty chart is written.
  """
  if all(r["graphpipe_over_sequential"] is None for r in ratio_rows):
    return (
      "no ratio.png: no model and device count has both a graphpipe and a "
      "sequential plan (--planners needs both for the ratio)"
    )
  path = os.path.join(out, "ratio.png")
  title = f"simulated throughput ratio ({device})"
  if not plot_ratios(path, ratio_rows, title):
    return "no ratio.png: matplotlib is not installed (pip install matplotlib)"
  return f"wrote {path}"


def define_flags() -> None:
  """This experiment's flags (defined when run, so tests import freely)."""
  common.define_flags()
  flags.DEFINE_list(
    "models",
    ["mmt", "dlrm", "candle_uno", "transformer", "two_branch"],
    "Zoo models.",
  )
  flags.DEFINE_list("devices", ["4", "8", "16", "32"], "Device counts.")
  flags.DEFINE_list(
    "planners",
    list(DEFAULT_PLANNERS),
    f"Planners to compare, of {', '.join(PLANNERS)}.",
  )
  from graphpipe.costs.analytic import PRESETS

  flags.DEFINE_enum("device", "v100", PRESETS, "Device preset.")
  flags.DEFINE_enum("config", "paper", models.SIZES, "Model size.")
  common.check_choices("models", models.NAMES)
  common.check_int_list("devices")
  common.check_choices("planners", PLANNERS)
  common.define_piper_budget()
  flags.DEFINE_bool("plots", True, "Draw ratio.png (needs matplotlib).")
  common.define_out()


def main(argv):
  common.start(argv)
  options = flags.FLAGS
  try:
    device_counts = [int(d) for d in options.devices]
  except ValueError as err:
    raise app.UsageError(f"--devices takes integers: {err}") from err
  start = time.perf_counter()
  try:
    results = compare(
      model_names=options.models,
      device_counts=device_counts,
      planners=options.planners,
      device=options.device,
      config=options.config,
      piper_budget=options.piper_budget,
    )
  except GraphpipeError as err:
    raise SystemExit(f"experiments.compare_planners: {err}") from err
  results["config"] = {
    "models": options.models,
    "devices": device_counts,
    "planners": options.planners,
    "device": options.device,
    "config": options.config,
    "piper_budget": options.piper_budget,
    "batch_size": "graphpipe.models.default_batch_size",
  }
  results["total_time_s"] = time.perf_counter() - start
  common.write_results(options.out, results)
  for r in results["ratios"]:
    ratio = r["graphpipe_over_sequential"]
    text = f"{ratio:.3f}" if ratio is not None else "n/a"
    print(
      f"{r['model']:<12} {r['num_devices']:>3} devices: graphpipe / "
      f"sequential = {text}"
    )
  if options.plots:
    common.log(write_plot(options.out, results["ratios"], options.device))
  print(f"wrote {options.out}/results.json")


if __name__ == "__main__":
  define_flags()
  app.run(main)
