"""The PNGs of `experiments.reproduce`, one per figure, from its results."""

from __future__ import annotations

import os

from experiments.reproduction.paper import PAPER
from experiments.reproduction.sweep import ceiling


def draw(results, out: str) -> list[str]:
  """One PNG per figure; [] without matplotlib."""
  try:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
  except ImportError:
    return []

  def figure(name, draw, width=7.0, height=4.0):
    fig = Figure(figsize=(width, height))
    FigureCanvasAgg(fig)
    draw(fig)
    fig.tight_layout()
    path = os.path.join(out, f"{name}.png")
    fig.savefig(path, dpi=110)
    return f"{name}.png"

  names = []

  def throughput(fig):
    models = sorted({r["model"] for r in results["throughput"]["rows"]})
    for i, model in enumerate(models):
      axes = fig.add_subplot(1, len(models), i + 1)
      for planner in ("graphpipe", "sequential", "piper"):
        points = sorted(
          (r["num_devices"], r["throughput_samples_per_s"])
          for r in results["throughput"]["rows"]
          if r["model"] == model
          and r["planner"] == planner
          and "error" not in r
        )
        if points:
          axes.plot(*zip(*points, strict=True), marker="o", label=planner)
      axes.set_xscale("log", base=2)
      axes.set_title(model)
      axes.set_xlabel("devices")
      if i == 0:
        axes.set_ylabel("samples/s (simulated)")
        axes.legend(fontsize=7)

  names.append(figure("throughput", throughput, 10, 3.5))

  def bars(fig, keys, values, paper, title, ylabel):
    axes = fig.add_subplot()
    axes.bar([str(k) for k in keys], values, color="#1f77b4", label="ours")
    for level in paper:
      axes.axhline(level, color="#d62728", linestyle="--", linewidth=1)
    axes.axhline(1.0, color="grey", linewidth=0.8)
    axes.set_title(title)
    axes.set_ylabel(ylabel)

  sweep = sorted(
    results["branch_sweep"]["speedup"], key=lambda e: e["branches"]
  )

  def branch_sweep(fig):
    bars(
      fig,
      [e["branches"] for e in sweep],
      [e["graphpipe_over_best_baseline"] or 0 for e in sweep],
      [PAPER["branch_sweep"]["speedup_at_16"]],
      "CANDLE-Uno: GraphPipe / best baseline\n(dashed: paper at 16; "
      "black: ceiling of any plan over sequential)",
      "speed-up",
    )
    ceilings = [
      (str(e["branches"]), ceiling(results, e["branches"])) for e in sweep
    ]
    marks = [(k, c) for k, c in ceilings if c is not None]
    if marks:
      fig.axes[0].scatter(
        *zip(*marks, strict=True), marker="_", s=600, color="black"
      )

  names.append(figure("branch_sweep", branch_sweep))

  def ablation(fig):
    rows = results["ablation"]["rows"]
    axes = fig.add_subplot()
    x = range(len(rows))
    axes.bar(
      [i - 0.2 for i in x],
      [_nan(r["concurrency_only"]) for r in rows],
      0.4,
      label="concurrency only",
    )
    axes.bar(
      [i + 0.2 for i in x],
      [r["concurrency_and_micro_batch"] for r in rows],
      0.4,
      label="+ own micro-batch",
    )
    for level in PAPER["ablation"]["concurrency_only"]:
      axes.axhline(level, color="#d62728", linestyle="--", linewidth=1)
    axes.set_xticks(list(x), [r["model"] for r in rows])
    axes.axhline(1.0, color="grey", linewidth=0.8)
    axes.set_ylabel("over sequential (dashed: paper, concurrency only)")
    axes.legend(fontsize=7)

  names.append(figure("ablation", ablation))

  def search(fig):
    rows = results["search_time"]["rows"]
    models = sorted({r["model"] for r in rows})
    axes = fig.add_subplot()
    for j, planner in enumerate(("graphpipe", "sequential", "piper")):
      values = [
        next(
          (
            r["search_time_s"]
            for r in rows
            if r["model"] == m and r["planner"] == planner
          ),
          0,
        )
        for m in models
      ]
      hatch = [
        not next(
          (
            r["found_plan"]
            for r in rows
            if r["model"] == m and r["planner"] == planner
          ),
          True,
        )
        for m in models
      ]
      bars_ = axes.bar(
        [i + 0.27 * (j - 1) for i in range(len(models))],
        values,
        0.27,
        label=planner,
      )
      for bar, no_plan in zip(bars_, hatch, strict=True):
        if no_plan:
          bar.set_hatch("//")
    axes.set_yscale("log")
    axes.set_xticks(range(len(models)), models)
    axes.set_ylabel("search time (s); hatched: no plan")
    axes.legend(fontsize=7)

  names.append(figure("search_time", search))

  def case(fig):
    data = results["case_study"]
    labels, values = [], []
    for r in data["rows"]:
      if "error" not in r:
        labels.append(
          f"{r['planner']}\nd={r['depth']} b={r['micro_batch_size']}"
        )
        values.append(r["throughput_samples_per_s"])
    for kind, r in data["paper_plans"].items():
      labels.append(f"paper {kind}\nd={r['depth']} b={r['micro_batch_size']}")
      values.append(r["throughput_samples_per_s"])
    axes = fig.add_subplot()
    axes.bar(
      labels, values, color=["#1f77b4"] * (len(values) - 2) + ["#ff7f0e"] * 2
    )
    axes.set_ylabel("samples/s (simulated)")
    axes.set_title("two-branch case study, 8 devices")
    axes.tick_params(axis="x", labelsize=7)

  names.append(figure("case_study", case))

  def parity(fig):
    entries = sorted(
      results["parity"]["speedup"], key=lambda e: e["num_devices"]
    )
    axes = fig.add_subplot()
    axes.plot(
      [e["num_devices"] for e in entries],
      [e["graphpipe_over_sequential"] or 0 for e in entries],
      marker="o",
    )
    axes.axhline(1.0, color="#d62728", linestyle="--", linewidth=1)
    axes.set_ylim(0.9, 1.1)
    axes.set_xscale("log", base=2)
    axes.set_xlabel("devices")
    axes.set_ylabel("graphpipe / sequential (transformer)")

  names.append(figure("parity", parity))

  def per_stage(fig):
    rows = results["per_stage"]["rows"]
    axes = fig.add_subplot()
    at = range(len(rows))
    axes.bar(
      [x - 0.2 for x in at],
      [r["speedup"] for r in rows],
      width=0.4,
      label="padding trade (default)",
    )
    axes.bar(
      [x + 0.2 for x in at],
      [r["speedup_time_only"] for r in rows],
      width=0.4,
      label="time alone",
    )
    memory = results["per_stage"].get("memory_rows", [])
    after = range(len(rows), len(rows) + len(memory))
    axes.bar(
      list(after),
      [r["speedup_time_only"] for r in memory],
      width=0.4,
      label="time alone, memory x share",
    )
    axes.set_xticks(
      [*at, *after],
      [f"{r['model']}\n{r['num_devices']}" for r in rows]
      + [
        f"{r['model']}\n{r['num_devices']}\nx{r['memory_share']}"
        for r in memory
      ],
    )
    axes.legend(fontsize=7)
    axes.axhline(1.0, color="grey", linewidth=0.8)
    axes.set_ylabel("per-stage sizes / one size")
    axes.tick_params(axis="x", labelsize=6)

  names.append(figure("per_stage", per_stage, 9, 3.5))

  def check(fig):
    rows = results["pipedream_check"]["rows"]
    axes = fig.add_subplot()
    axes.bar(
      [f"{r['model']}\n{r['num_devices']}" for r in rows],
      [r["pipedream_speedup"] for r in rows],
    )
    axes.axhline(1.02, color="#d62728", linestyle="--", linewidth=1)
    axes.set_ylabel("PipeDream / sequential speed (dashed: 1.02)")
    axes.tick_params(axis="x", labelsize=7)

  names.append(figure("pipedream_check", check))
  return names


def _nan(value):
  """A bar's height: NaN (no bar) for a ratio without a plan."""
  return float("nan") if value is None else value
