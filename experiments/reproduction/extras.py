"""The sections of REPRODUCTION.md that are not paper figures.

Per-stage micro-batch sizes (GraphPipe's optional extension, no numbers in
the paper) and the check of our sequential baseline against PipeDream's
own partitioner; `experiments.reproduction.report` assembles the report.
"""

from __future__ import annotations

from graphpipe.planning import engine


def ratio(x) -> str:
  """A speed ratio as the report prints it ('n/a' for None)."""
  return "n/a" if x is None else f"{x:.2f}x"


def cell(rows, planner) -> str:
  """A table cell: `planner`'s samples/s among `rows`, or why there is
  none."""
  row = next((r for r in rows if r["planner"] == planner), None)
  if row is None:
    return "-"
  if "error" in row:
    return "no plan"
  return f"{row['throughput_samples_per_s']:.4g}"


def seconds(x: float) -> str:
  """A duration, three significant figures in s, ms or us."""
  for unit, scale in (("s", 1), ("ms", 1e3)):
    if x * scale >= 1:
      return f"{_sig(x * scale)} {unit}"
  return f"{_sig(x * 1e6)} us"


def size(n: float) -> str:
  """Bytes in GiB, MiB, KiB or bytes, three significant figures."""
  for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
    if n >= scale:
      return f"{_sig(n / scale)} {unit}"
  return f"{n:.0f} bytes"


def times(x: float) -> str:
  """A factor ('12.3x', '0.034x'): a tenth, or two significant figures."""
  return f"{x:.2g}x" if x < 1 else f"{x:.1f}x"


def _sig(x: float) -> str:
  """Three significant figures, never in exponent form."""
  return f"{x:.3g}" if abs(x) < 1000 else f"{x:.0f}"


def percent(x: float) -> str:
  """A fraction as a percentage, as many digits as it has ('1.5%', '2%')."""
  return f"{_sig(x * 100)}%"


def per_stage_section(results) -> list[str]:
  if "per_stage" not in results:  # results of an older run
    return []
  rows = results["per_stage"]["rows"]
  lines = [
    "## Per-stage micro-batch sizes (`per_stage`, per_stage.png)",
    "",
    "Paper: an optional extension, no numbers given.",
    "",
    "Samples/s with the planner's default padding trade (of the plans "
    f"within {percent(engine.PADDING_TOLERANCE)} of the fastest, a less padded "
    "one where its padding falls by more than its time grows), then ranked "
    "by time alone (`padding_tolerance=0`).",
    "",
    "| model | devices | one size | per-stage sizes | sizes | speed-up "
    "| time alone: one size | per-stage | sizes | speed-up |",
    "|---|---|---|---|---|---|---|---|---|---|",
  ]
  for r in rows:
    lines.append(
      f"| {r['model']} | {r['num_devices']} | {r['uniform']:.4g} | "
      f"{r['per_stage']:.4g} | {r['micro_batch_sizes']} | "
      f"{ratio(r['speedup'])} | {r['uniform_time_only']:.4g} | "
      f"{r['per_stage_time_only']:.4g} | "
      f"{r['micro_batch_sizes_time_only']} | "
      f"{ratio(r['speedup_time_only'])} |"
    )
  lines.append("")
  for label, sizes, speedup in (
    ("Ours, with the padding trade:", "micro_batch_sizes", "speedup"),
    (
      "Ours, by time alone:",
      "micro_batch_sizes_time_only",
      "speedup_time_only",
    ),
  ):
    won = [r for r in rows if len(r[sizes]) > 1]
    ratios = [r[speedup] for r in rows]
    lines.append(
      f"{label} the planner picks unequal sizes in {len(won)} of "
      f"{len(rows)} configurations"
      + (f", best {max(r[speedup] for r in won):.3f}x" if won else "")
      + (
        f"; per-stage / one size {min(ratios):.3f}-{max(ratios):.3f}x."
        if ratios
        else "."
      )
    )
  lines.append(
    "(With the trade, a per-stage search that ranks more candidates may "
    "settle on a less padded plan up to "
    f"{percent(engine.PADDING_TOLERANCE)} slower.) The Trainer runs "
    "unequal sizes exactly like one-size plans (a stage k times larger "
    "collects k forwards and returns its gradients in k pieces)."
  )
  return lines + _memory_bound(results["per_stage"].get("memory_rows", []))


def _memory_bound(rows) -> list[str]:
  if not rows:
    return []
  lines = [
    "",
    "Where memory binds (by time alone, devices with a share of the "
    "preset's memory):",
    "",
    "| model | devices | memory | one size | per-stage sizes | sizes "
    "| speed-up |",
    "|---|---|---|---|---|---|---|",
  ]
  for r in rows:
    lines.append(
      f"| {r['model']} | {r['num_devices']} | "
      f"{r['memory_bytes'] / 2**30:.2f} GiB | {r['uniform_time_only']:.4g} "
      f"| {r['per_stage_time_only']:.4g} | "
      f"{r['micro_batch_sizes_time_only']} | "
      f"{ratio(r['speedup_time_only'])} |"
    )
  won = [r for r in rows if len(r["micro_batch_sizes_time_only"]) > 1]
  lines += [
    "",
    f"Ours, where memory binds: unequal sizes in {len(won)} of {len(rows)} "
    "configurations"
    + (
      f", up to {max(r['speedup_time_only'] for r in won):.2f}x over the "
      "best one-size plan: a pipeline's first stages hold the most "
      "micro-batches in flight, so they take small ones and later stages "
      "large ones, where one size must be small enough for the first."
      if won
      else "."
    ),
  ]
  return lines


def pipedream_section(results) -> list[str]:
  if "pipedream_check" not in results:  # results of an older run
    return []
  rows = results["pipedream_check"]["rows"]
  lines = [
    "## PipeDream's own partitioner against `sequential` "
    "(`pipedream_check`, pipedream_check.png)",
    "",
    "Not a paper figure: the check that our baseline is PipeDream-grade. "
    "Each PipeDream partition (its published DP, every micro-batch size, "
    "both tie rules) is simulated; the table gives the fastest.",
    "",
    "| model | devices | PipeDream / sequential speed | at most 2% faster |",
    "|---|---|---|---|",
  ]
  for r in rows:
    lines.append(
      f"| {r['model']} | {r['num_devices']} | {r['pipedream_speedup']:.3f} | "
      f"{'yes' if r['passes'] else 'NO'} |"
    )
  lines.append("")
  if rows:
    lines.append(
      f"{sum(r['passes'] for r in rows)} of {len(rows)} configurations: no "
      "PipeDream partition simulates more than 2% faster than "
      "`sequential`'s plan."
    )
  return lines
