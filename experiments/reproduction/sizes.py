"""`experiments.reproduce`'s per-stage figure: GraphPipe with per-stage
micro-batch sizes against one size (key `per_stage` of results.json)."""

from __future__ import annotations

from graphpipe.costs import device_spec


def per_stage(setup, names, through: dict, progress, run_planner, note) -> dict:
  """Per model (`names`) and device count of the throughput figure: with the
  planner's padding trade and by time alone; then `per_stage_memory`.
  `run_planner` and `note` are `experiments.reproduce`'s (a row of the
  results; its progress line)."""
  out = []
  for name in names:
    for devices in setup.devices:
      uniform = next(
        (
          r
          for r in through["rows"]
          if (r["model"], r["num_devices"], r["planner"])
          == (name, devices, "graphpipe")
        ),
        None,
      )
      if uniform is None or "error" in uniform:
        continue
      sized = run_planner(
        setup,
        setup.graph(name),
        name,
        devices,
        "graphpipe",
        per_stage_micro_batches=True,
      )
      progress.step("per-stage sizes: " + note(sized))
      # The same pair ranked by time alone (no padding trade): what
      # per-stage sizes are worth in throughput, unmixed with memory.
      timed = _by_time_alone(setup, name, devices, run_planner)
      progress.step("per-stage sizes, time alone: " + note(timed["per_stage"]))
      if any("error" in r for r in (sized, *timed.values())):
        continue
      out.append(
        {
          "model": name,
          "num_devices": devices,
          "uniform": uniform["throughput_samples_per_s"],
          "per_stage": sized["throughput_samples_per_s"],
          "micro_batch_sizes": sorted(set(sized["micro_batch_sizes"])),
          "speedup": sized["throughput_samples_per_s"]
          / uniform["throughput_samples_per_s"],
          **_time_alone_fields(timed),
        }
      )
  memory = per_stage_memory(setup, names, progress, run_planner, note)
  return {"rows": out, "memory_rows": memory}


def per_stage_memory(setup, names, progress, run_planner, note) -> list[dict]:
  """Per-stage sizes against one size, by time alone, on devices with a
  share of the preset's memory (at 16 devices, or the most up to 16): the
  first stages of a pipeline hold the most micro-batches in flight, so
  where memory binds they need small ones while later stages need not."""
  small = [d for d in setup.devices if d <= 16] or [min(setup.devices)]
  devices = max(small)
  memory = device_spec(setup.device).memory_bytes
  out = []
  for name in names:
    for share in setup.memory_shares:
      timed = _by_time_alone(
        setup, name, devices, run_planner, memory_bytes=share * memory
      )
      progress.step(
        f"per-stage sizes, memory x {share}: " + note(timed["per_stage"])
      )
      if any("error" in r for r in timed.values()):
        continue
      out.append(
        {
          "model": name,
          "num_devices": devices,
          "memory_share": share,
          "memory_bytes": share * memory,
          **_time_alone_fields(timed),
        }
      )
  return out


def _by_time_alone(setup, name, devices, run_planner, **options) -> dict:
  """GraphPipe's rows with one size and per-stage sizes, ranked by time
  alone (no padding trade), keyed 'uniform' and 'per_stage'."""
  return {
    key: run_planner(
      setup,
      setup.graph(name),
      name,
      devices,
      "graphpipe",
      per_stage_micro_batches=key == "per_stage",
      padding_tolerance=0.0,
      **options,
    )
    for key in ("uniform", "per_stage")
  }


def _time_alone_fields(timed: dict) -> dict:
  """A row's '*_time_only' entries from `_by_time_alone`'s pair."""
  speed = {k: r["throughput_samples_per_s"] for k, r in timed.items()}
  return {
    "uniform_time_only": speed["uniform"],
    "per_stage_time_only": speed["per_stage"],
    "micro_batch_sizes_time_only": sorted(
      set(timed["per_stage"]["micro_batch_sizes"])
    ),
    "speedup_time_only": speed["per_stage"] / speed["uniform"],
  }
