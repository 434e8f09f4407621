"""The branch sweep's section of REPRODUCTION.md (`report`).

Besides the speed-ups, it sets out the ceiling no plan passes in this cost
model (`graphpipe.simulator.iteration_floor`), so a figure below the
paper's says whether any planner could have reached it, and which split
of the layer after the concatenation each planner chose.
"""

from __future__ import annotations

from experiments.reproduction.extras import cell, ratio, seconds, size
from experiments.reproduction.paper import PAPER


def _rows(results, branches):
  return [
    r for r in results["branch_sweep"]["rows"] if r["branches"] == branches
  ]


def _plural(branches) -> str:
  return f"{branches} branch{'es' if branches != 1 else ''}"


def branch_section(results) -> list[str]:
  data = results["branch_sweep"]
  devices = results["config"]["sweep_devices"]
  lines = [
    f"## CANDLE-Uno branch sweep at {devices} devices (`branch_sweep`, "
    "branch_sweep.png)",
    "",
    f"Paper: {PAPER['branch_sweep']['claim']}.",
    "",
    "| branches | graphpipe | sequential | piper | graphpipe / best baseline "
    "| ceiling: any plan / sequential |",
    "|---|---|---|---|---|---|",
  ]
  entries = sorted(data["speedup"], key=lambda e: e["branches"])
  series = []
  for entry in entries:
    rows = _rows(results, entry["branches"])
    value = entry["graphpipe_over_best_baseline"]
    series.append((entry["branches"], value))
    lines.append(
      f"| {entry['branches']} | {_cell(rows, 'graphpipe')} | "
      f"{_cell(rows, 'sequential')} | {_cell(rows, 'piper')} | "
      f"{ratio(value)} | {ratio(ceiling(results, entry['branches']))} |"
    )
  lines.append("")
  lines += _split_sentences(results)
  known = [(b, r) for b, r in series if r is not None]
  if not known:
    return lines
  paper = PAPER["branch_sweep"]["speedup_at_16"]
  values = [r for _, r in known]
  last, top = known[-1]
  lines.append(
    "Ours: "
    + ", ".join(
      f"{_plural(b)} "
      + (ratio(r) if r is not None else _missing(_rows(results, b)))
      for b, r in series
    )
    + (
      f"; the speed-up {_growth(values)} with the branches and reaches "
      f"{top:.2f}x at {_plural(last)}"
      if len(known) > 1
      else ""
    )
    + f" against the paper's {paper}x at 16."
  )
  floor, cap = _floor(results, last), ceiling(results, last)
  if top < paper and cap is not None and cap < paper:
    # The floor's node is the reason only where it bounds every plan
    # below the paper's figure; otherwise the ceiling sentence says how
    # much room was left.
    weights = (
      f" ({size(floor['param_bytes'])} of weights)"
      if floor.get("param_bytes")
      else ""
    )
    parts = max(data.get("split_parts") or [1])
    split = (
      f", with the layer split into up to {parts} parts"
      if parts > 1
      else " (the sweep did not split it: --split_parts=1)"
    )
    lines.append(
      f"Why lower: at {_plural(last)} node `{floor['node']}`{weights} "
      "bounds every planner's iteration alike: on few devices its compute "
      "is slow, on many its gradient all-reduce and optimizer step add up"
      f"{split}."
    )
  lines += _ceiling_sentences(results, last)
  first, start = known[0]
  entry = next(e for e in entries if e["branches"] == first)
  if start < 1.0 and entry.get("best_baseline", "sequential") == "sequential":
    lines.append(
      f"At {_plural(first)} the sequential plan is faster than GraphPipe's "
      f"({start:.2f}x): a chain's stage may hold the same layer of several "
      "branches, a cut GraphPipe's series-parallel DP never makes."
    )
  elif start < 1.0:
    lines.append(
      f"At {_plural(first)} {entry['best_baseline']}'s plan is faster than "
      f"GraphPipe's ({start:.2f}x): a DP over down-sets reaches stage "
      "graphs that are not series-parallel, which GraphPipe's DP never "
      "builds."
    )
  return lines


def _cell(rows, planner) -> str:
  """`cell`, with the parts of the split layer where the row split it."""
  row = next((r for r in rows if r["planner"] == planner), None)
  parts = (row or {}).get("split_parts", 1)
  text = cell(rows, planner)
  if parts > 1 and "error" not in row:
    text += f" ({parts} parts)"
  return text


def _split_sentences(results) -> list[str]:
  """Which splits were planned and which each planner kept."""
  data = results["branch_sweep"]
  options = data.get("split_parts") or [1]
  if max(options) <= 1:
    return []
  layer = data.get("split_layer", "the layer after the concatenation")
  shown = ", ".join(str(p) for p in options if p > 1)
  last = max(r["branches"] for r in data["rows"])
  chosen = [
    f"{r['planner']} {r.get('split_parts', 1)}"
    for r in data["rows"]
    if r["branches"] == last and "error" not in r
  ]
  return [
    f"Every planner planned each branch count with `{layer}` whole and in "
    f"{shown} parts (`graphpipe.capture`'s `split_layers`: the layer's "
    "product cut by output features, each part a node; tensor "
    "parallelism as graph branches) and kept its fastest plan; parts "
    f"chosen at {_plural(last)}: {', '.join(chosen) or 'none'}. GraphPipe "
    "runs the parts as concurrent stages; a chain planner can only give "
    "them consecutive stages, each carrying the layer's input and the "
    "parts done so far.",
    "",
  ]


def _missing(rows) -> str:
  """Why a configuration has no speed-up: whose plan is missing."""
  ours = next((r for r in rows if r["planner"] == "graphpipe"), None)
  if ours is None or "error" in ours:
    return "(no GraphPipe plan)"
  return "(no baseline plan)"


def _growth(values: list[float]) -> str:
  """How a series of speed-ups moves, as printed (two decimals): 'grows',
  'stays flat', 'does not grow steadily'."""
  shown = [round(v, 2) for v in values]
  steps = list(zip(shown, shown[1:], strict=False))
  if all(b == a for a, b in steps):
    return "stays flat"
  if all(b >= a for a, b in steps):
    return "grows"
  return "does not grow steadily"


def _floor(results, branches) -> dict | None:
  floors = results["branch_sweep"].get("floor", {})
  return floors.get(branches) or floors.get(str(branches))


def ceiling(results, branches) -> float | None:
  """Sequential's iteration over the floor: no plan's speed-up is higher."""
  floor = _floor(results, branches)
  rows = _rows(results, branches)
  seq = next((r for r in rows if r["planner"] == "sequential"), None)
  if not floor or not seq or "error" in seq or floor["seconds"] <= 0:
    return None
  return seq["iteration_time_s"] / floor["seconds"]


def _ceiling_sentences(results, branches) -> list[str]:
  """What the iteration floor (one node alone) says of the sweep."""
  floor, cap = _floor(results, branches), ceiling(results, branches)
  entry = next(
    e for e in results["branch_sweep"]["speedup"] if e["branches"] == branches
  )
  value = entry["graphpipe_over_sequential"]
  if cap is None or value is None:
    return []
  paper = PAPER["branch_sweep"]["speedup_at_16"]
  verdict = (
    f"the paper's {paper}x is out of reach for any planner here"
    if cap < paper
    else f"room up to the paper's {paper}x"
  )
  return [
    f"Ceiling: at {_plural(branches)} node `{floor['node']}` alone takes "
    f"at least {seconds(floor['seconds'])} an iteration (best on "
    f"{floor['devices']} device{'s' if floor['devices'] > 1 else ''}: "
    "its forward and backward over the whole "
    "batch in one micro-batch, its gradient all-reduce and its optimizer "
    "step; `graphpipe.simulator.iteration_floor`), so no plan in this "
    f"cost model beats sequential by more than {cap:.2f}x ({verdict}); "
    f"GraphPipe reaches {value / cap:.0%} of that ceiling (the floor "
    "counts neither the pipeline's fill nor the smaller micro-batches that "
    "a pipeline needs)."
  ]


def split_throughput_section(results) -> list[str]:
  """CANDLE-Uno's throughput with each planner at its fastest split."""
  data = results.get("split_throughput")
  if not data or not data["rows"]:
    return []
  whole = {
    e["num_devices"]: e["graphpipe_over_best_baseline"]
    for e in results["throughput"]["speedup"]
    if e["model"] == "candle_uno"
  }
  layer = data.get("split_layer", "the layer after the concatenation")
  shown = ", ".join(str(p) for p in data["split_parts"])
  lines = [
    "## CANDLE-Uno throughput with a split layer (`split_throughput`)",
    "",
    "Paper: pipeline and data parallelism only (no split layers).",
    "",
    f"Each planner planned the paper config with `{layer}` in {shown} "
    "part(s) and kept its fastest plan (the same options for all).",
    "",
    "| devices | graphpipe | sequential | piper | graphpipe / best "
    "baseline | unsplit (`throughput`) |",
    "|---|---|---|---|---|---|",
  ]
  entries = sorted(data["speedup"], key=lambda e: e["num_devices"])
  for entry in entries:
    rows = [r for r in data["rows"] if r["num_devices"] == entry["num_devices"]]
    lines.append(
      f"| {entry['num_devices']} | {_cell(rows, 'graphpipe')} | "
      f"{_cell(rows, 'sequential')} | {_cell(rows, 'piper')} | "
      f"{ratio(entry['graphpipe_over_best_baseline'])} | "
      f"{ratio(whole.get(entry['num_devices']))} |"
    )
  lines.append("")
  known = [
    (e["num_devices"], e["graphpipe_over_best_baseline"])
    for e in entries
    if e["graphpipe_over_best_baseline"] is not None
  ]
  if known:
    lines.append(
      "Ours: "
      + ", ".join(f"{d} devices {r:.2f}x" for d, r in known)
      + " over the best baseline with the split layer, against "
      + ", ".join(f"{ratio(whole.get(d))}" for d, _ in known)
      + " unsplit."
    )
  return lines
