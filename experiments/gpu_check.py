"""The one prepared check for a machine with a GPU (or any one device).

  python -m experiments.gpu_check --out=DIR            # one GPU, < 8 min
  python -m experiments.gpu_check --smoke --out=DIR    # toy sizes, CPU, < 1 min

Three measurements, in this order, each written to `DIR/results.json` as
soon as it is done (a run cut short keeps what it measured):

(a) `nodes`: the zoo's paper models are captured (abstract weights) and up
    to `--nodes_per_model` nodes of each, evenly spaced along the graph,
    are timed forward and backward at every `--node_batch_sizes` size with
    `graphpipe.costs.time_node` (what `ProfiledCostModel` records). Each
    time is set beside the analytic model of the device's preset
    (`--preset`, default from the device kind: h200, h100, a100, v100 or
    cpu) for each compute dtype in `--dtypes` (on a GPU, XLA may run
    float32 matrix products as TF32: the two columns tell). Per model,
    size, kind and dtype: the median, 10th and 90th percentile of
    measured / analytic. `fit`: the efficiency curve (`max_efficiency`,
    `half_efficiency_elements` of `DeviceSpec`) that best explains the
    measured times (least squares of log time over a grid), beside the
    preset's; put it into the preset when the spread says it is better.
(b) `overhead`: `experiments.bench_overhead`'s one-device rows on this
    device (a one-stage `Trainer` against plain JAX doing the same
    arithmetic, both schedules; losses and weights checked equal).
(c) `tick`: the cost of one idle tick of the step loop on this device
    (the loop, its conditionals and, on a GPU, their host round-trips).

`--budget_s` bounds the whole run: a part that would start after it is skipped
and listed under `skipped`. Run it on the lent GPU machine with the `device`
tool, then record the figures in BUILD.md ("GPUs") and docs/guide/training.md.
"""

import time

import numpy as np
from absl import app, flags

from experiments import bench_overhead, common
from graphpipe.errors import CostModelError

GPU_PRESETS = ("h200", "h100", "a100", "v100")
# Compute dtypes the analytic presets price (`DeviceSpec.peak_flops`).
DTYPES = ("float32", "tfloat32", "bfloat16", "float16")


# The flags --smoke sets (given with it, they would be overwritten).
SMOKE_FLAGS = ("models", "node_batch_sizes", "nodes_per_model", "node_repeats")


def _define_flags():
  from graphpipe import models
  from graphpipe.costs.analytic import PRESETS

  bench_overhead.define_flags()
  flags.DEFINE_list(
    "models", ["mmt", "dlrm", "candle_uno", "transformer"], "Zoo models."
  )
  common.check_choices("models", models.NAMES)
  flags.DEFINE_list(
    "node_batch_sizes", ["1", "4", "16", "64"], "Micro-batch sizes of (a)."
  )
  common.check_int_list("node_batch_sizes")
  flags.DEFINE_integer(
    "nodes_per_model", 16, "Nodes timed per model.", lower_bound=1
  )
  flags.DEFINE_integer(
    "node_repeats", 3, "Timed calls per node and size.", lower_bound=1
  )
  flags.DEFINE_enum(
    "preset",
    None,
    PRESETS,
    "Analytic preset to compare with (default: detected).",
  )
  flags.DEFINE_list(
    "dtypes",
    None,
    "Compute dtypes of the preset (default: GPU float32 and "
    "tfloat32, CPU float32).",
  )
  common.check_choices("dtypes", DTYPES)
  flags.DEFINE_float(
    "budget_s", 450.0, "Skip parts that start later.", lower_bound=0
  )


def detect_preset(device_kind: str, platform: str) -> str:
  """The preset name for a JAX device kind, e.g. 'NVIDIA H200' -> 'h200'.

  Example:
    >>> detect_preset("NVIDIA H100 80GB HBM3", "gpu")
    'h100'
    >>> detect_preset("cpu", "cpu")
    'cpu'
  """
  kind = device_kind.lower()
  for name in GPU_PRESETS:
    if name in kind:
      return name
  if platform == "cpu":
    return "cpu"
  raise CostModelError(
    f"no analytic preset for device kind {device_kind!r}: pass --preset"
  )


def node_ids(num_nodes: int, count: int) -> list[int]:
  """`count` node ids evenly spaced over `num_nodes` (all if fewer).

  Example:
    >>> node_ids(10, 4)
    [0, 3, 6, 9]
  """
  if count >= num_nodes:
    return list(range(num_nodes))
  return sorted({int(round(x)) for x in np.linspace(0, num_nodes - 1, count)})


def time_nodes(graph, ids, batch_sizes, repeats) -> list[dict]:
  """Measured forward and backward seconds of nodes `ids` at each size."""
  from graphpipe.costs import time_node

  rows = []
  for b in batch_sizes:
    program = graph.program.at_batch_size(b)
    for i in ids:
      fwd, bwd = time_node(program.nodes[i], seed=i, repeats=repeats)
      for kind, seconds in (("fwd", fwd), ("bwd", bwd)):
        rows.append(
          {"node": i, "batch": b, "kind": kind, "measured_s": seconds}
        )
  return rows


def compare(graph, rows, spec, dtypes) -> None:
  """Adds `analytic_s` and `ratio` (measured / analytic) per dtype."""
  from graphpipe.costs import AnalyticCostModel

  models = {d: AnalyticCostModel(spec, dtype=d) for d in dtypes}
  for row in rows:
    node = graph.nodes[row["node"]]
    row["analytic_s"], row["ratio"] = {}, {}
    for d, model in models.items():
      predicted = model.node_time(node, row["batch"], row["kind"])
      row["analytic_s"][d] = predicted
      if predicted > 0 and row["measured_s"] > 0:
        row["ratio"][d] = row["measured_s"] / predicted


def summarise(model: str, rows, dtypes) -> list[dict]:
  """Median and spread of the ratio per size, kind and dtype."""
  out = []
  for b in sorted({r["batch"] for r in rows}):
    for kind in ("fwd", "bwd"):
      for d in dtypes:
        ratios = [
          r["ratio"][d]
          for r in rows
          if r["batch"] == b and r["kind"] == kind and d in r["ratio"]
        ]
        if ratios:
          p10, p50, p90 = np.percentile(ratios, [10, 50, 90])
          out.append(
            {
              "model": model,
              "batch": b,
              "kind": kind,
              "dtype": d,
              "count": len(ratios),
              "median": float(p50),
              "p10": float(p10),
              "p90": float(p90),
            }
          )
  return out


def fit_efficiency(samples, spec, dtype: str) -> dict:
  """The (max_efficiency, half_efficiency_elements) that fit best.

  `samples` are (node, batch, kind, measured seconds) of nodes with FLOPs;
  the error is the mean squared log of predicted / measured.
  """
  import dataclasses

  from graphpipe.costs import AnalyticCostModel

  samples = [s for s in samples if s[3] > 0 and s[0].cost("fwd_flops", 1) > 0]
  if not samples:
    return {}
  measured = np.log([s[3] for s in samples])

  def error(max_eff, half):
    trial = dataclasses.replace(
      spec, max_efficiency=max_eff, half_efficiency_elements=half
    )
    model = AnalyticCostModel(trial, dtype=dtype)
    predicted = [model.node_time(n, b, k) for n, b, k, _ in samples]
    return float(np.mean((np.log(predicted) - measured) ** 2))

  preset = (spec.max_efficiency, spec.half_efficiency_elements)
  grid = [preset] + [
    (m, spec.half_efficiency_elements * 2.0**e)
    for m in np.linspace(0.05, 1.0, 20)
    for e in range(-6, 7)
  ]
  best = min(grid, key=lambda g: error(*g))
  return {
    "dtype": dtype,
    "samples": len(samples),
    "preset": {
      "max_efficiency": spec.max_efficiency,
      "half_efficiency_elements": spec.half_efficiency_elements,
      "rms_log_error": error(spec.max_efficiency, spec.half_efficiency_elements)
      ** 0.5,
    },
    "fitted": {
      "max_efficiency": float(best[0]),
      "half_efficiency_elements": float(best[1]),
      "rms_log_error": error(*best) ** 0.5,
    },
  }


def check_nodes(options, spec, dtypes, size: str, deadline: float) -> dict:
  """Part (a) over `options.models`; stops starting models at `deadline`."""
  from graphpipe.models import capture_zoo

  batch_sizes = [int(b) for b in options.node_batch_sizes]
  result = {"rows": [], "summary": [], "skipped": []}
  samples = []
  progress = common.Progress(len(options.models), "model")
  for name in options.models:
    if time.perf_counter() > deadline:
      result["skipped"].append(name)
      continue
    graph = capture_zoo(name, size)
    ids = node_ids(len(graph.nodes), options.nodes_per_model)
    rows = time_nodes(graph, ids, batch_sizes, options.node_repeats)
    compare(graph, rows, spec, dtypes)
    for row in rows:
      row["model"] = name
      samples.append(
        (graph.nodes[row["node"]], row["batch"], row["kind"], row["measured_s"])
      )
    result["rows"] += rows
    result["summary"] += summarise(name, rows, dtypes)
    medians = [
      f"b={s['batch']} {s['kind']} {s['dtype']} {s['median']:.2f}"
      for s in result["summary"]
      if s["model"] == name and s["batch"] == max(batch_sizes)
    ]
    progress.step(f"{name}: {len(ids)} nodes; " + ", ".join(medians))
  result["fit"] = [fit_efficiency(samples, spec, d) for d in dtypes]
  return result


def main(argv):
  common.start(argv)
  import jax

  from graphpipe.costs import device_spec

  options = flags.FLAGS
  begin = time.perf_counter()
  deadline = begin + options.budget_s
  size = "paper"
  if options.smoke:
    bench_overhead.refuse_with_smoke(SMOKE_FLAGS + bench_overhead.SMOKE_FLAGS)
    bench_overhead.apply_smoke(options)
    options.transformers = []
    options.models = ["two_branch"]
    options.node_batch_sizes = ["1", "2"]
    options.nodes_per_model = 3
    options.node_repeats = 1
    size = "tiny"
  device = jax.devices()[0]
  preset = options.preset or detect_preset(device.device_kind, device.platform)
  spec = device_spec(preset)
  dtypes = options.dtypes or (
    ["float32", "tfloat32"] if device.platform == "gpu" else ["float32"]
  )
  unknown = [d for d in dtypes if d not in spec.peak_flops]
  if options.dtypes and unknown:
    raise app.UsageError(
      f"--dtypes {unknown} are not dtypes of the {preset} preset "
      f"({', '.join(spec.peak_flops)})"
    )
  dtypes = [d for d in dtypes if d in spec.peak_flops]
  results = {
    "device": {"platform": device.platform, "kind": device.device_kind},
    "preset": preset,
    "dtypes": dtypes,
    "config": {
      "smoke": options.smoke,
      "size": size,
      "models": list(options.models),
      "node_batch_sizes": [int(b) for b in options.node_batch_sizes],
      "nodes_per_model": options.nodes_per_model,
      "pairs": options.pairs,
    },
    "skipped": [],
  }
  common.log(f"device {device.device_kind} ({device.platform}): {preset}")
  results["nodes"] = check_nodes(options, spec, dtypes, size, deadline)
  results["skipped"] += [f"nodes:{m}" for m in results["nodes"]["skipped"]]
  common.write_results(options.out, results)
  one, _ = bench_overhead.cases(options)
  rows = []
  progress = common.Progress(2 * len(one), "overhead row")
  for case in one:
    for schedule in bench_overhead.SCHEDULES:
      if time.perf_counter() > deadline:
        results["skipped"].append(f"overhead:{case.model}:{schedule}")
        continue
      row = bench_overhead.measure_row(case, schedule, 1, options)
      rows.append(row)
      progress.step(
        f"{case.model} B={case.batch_size} m={case.microbatches} "
        f"{schedule}: ratio {row['ratio']:.3f}"
      )
  results["overhead"] = {"rows": rows}
  common.write_results(options.out, results)
  if one and time.perf_counter() <= deadline:
    results["tick"] = {
      "empty_tick_s": bench_overhead.empty_tick(one[0], 1, options),
      "model": one[0].model,
    }
    common.log(f"empty tick: {results['tick']['empty_tick_s'] * 1e6:.1f} us")
  else:
    results["skipped"].append("tick")
  results["wall_s"] = time.perf_counter() - begin
  path = common.write_results(options.out, results)
  print(f"wrote {path} in {results['wall_s']:.0f} s")
  for fit in results["nodes"]["fit"]:
    if fit:
      print(
        f"efficiency ({fit['dtype']}): preset "
        f"{fit['preset']['max_efficiency']:.2f} / "
        f"{fit['preset']['half_efficiency_elements']:.3g} (rms log error "
        f"{fit['preset']['rms_log_error']:.2f}), fitted "
        f"{fit['fitted']['max_efficiency']:.2f} / "
        f"{fit['fitted']['half_efficiency_elements']:.3g} "
        f"({fit['fitted']['rms_log_error']:.2f})"
      )
  for row in rows:
    print(
      f"{row['model']:16s} {row['schedule']:5s} B={row['batch_size']:4d} "
      f"m={row['micro_batches']}: ratio {row['ratio']:.3f}"
    )


if __name__ == "__main__":
  _define_flags()
  app.run(main)
