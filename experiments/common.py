"""What every experiment does: devices, environment, results, progress.

Importing this module does not import JAX, so an experiment can choose its
devices at the top of its file, before anything starts JAX:

  from experiments import common
  if __name__ == "__main__":
    common.use_cpu_devices(common.int_flag_from_argv("num_devices", 8))

Every experiment is an absl app with the same shape: a `define_flags()`
that `common.define_flags()` completes (`--quiet`), called only under
`__main__` (so tests import experiments without flag clashes), and a
`main(argv)` that calls `common.start(argv)` first. Progress goes through
absl logging (`common.log`, `common.Progress`) and `--quiet` silences it;
results are written by `common.write_results`, with the environment record
beside them.
"""

from __future__ import annotations

import datetime
import json
import logging as std_logging
import math
import os
import platform
import subprocess
import sys
import threading
import time

from absl import app, flags, logging

_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
# XLA flags that should make a CPU device single-threaded. On jax 0.10.2
# they are not enough on their own (JAX_NOTES): pin the process as well.
_SINGLE_THREAD_FLAGS = (
  "--xla_cpu_multi_thread_eigen=false",
  "intra_op_parallelism_threads=1",
)


def int_flag_from_argv(name: str, default: int) -> int:
  """An integer flag read from `sys.argv` before absl parses it.

  Needed for what must be decided before JAX starts (device counts).

  Example:
    >>> int_flag_from_argv("num_devices", 8)   # no --num_devices given
    8

  Args:
    name: the flag name without dashes.
    default: the value when the flag is absent.
  """
  for arg in sys.argv[1:]:
    if arg.startswith(f"--{name}="):
      try:
        return int(arg.split("=", 1)[1])
      except ValueError:
        raise SystemExit(f"--{name} takes an integer, got {arg}") from None
  return default


def use_cpu_devices(count: int) -> None:
  """Asks for `count` simulated CPU devices; call before JAX starts.

  Replaces any device count already in `XLA_FLAGS`. On a machine with an
  accelerator JAX still uses the accelerator; the flag only shapes the CPU
  platform.

  Example:
    >>> use_cpu_devices(8)
    >>> "--xla_force_host_platform_device_count=8" in os.environ["XLA_FLAGS"]
    True

  Args:
    count: CPU devices JAX should see.
  """
  kept = [
    f
    for f in os.environ.get("XLA_FLAGS", "").split()
    if not f.startswith(_DEVICE_COUNT_FLAG)
  ]
  os.environ["XLA_FLAGS"] = " ".join(kept + [f"{_DEVICE_COUNT_FLAG}={count}"])


def pin_to_core(core: int) -> None:
  """Pins this process to one CPU core; call before JAX starts.

  XLA then sizes its thread pools to that core, so one CPU device really
  uses one core (the single-thread XLA flags alone do not achieve it on
  jax 0.10.2). Cores are taken modulo the machine's count.

  Example:
    >>> pin_to_core(0)
    >>> os.sched_getaffinity(0)
    {0}

  Args:
    core: the core index.
  """
  os.sched_setaffinity(0, {core % os.cpu_count()})
  current = os.environ.get("XLA_FLAGS", "").split()
  extra = [f for f in _SINGLE_THREAD_FLAGS if f not in current]
  os.environ["XLA_FLAGS"] = " ".join(current + extra)


def release_threads() -> None:
  """Lets this process's helper threads run on any core again.

  Call after `pin_to_core` and after JAX made its CPU client: the calling
  thread and XLA's compute pool (threads named tf_XLAEigen, sized to the
  one core) stay pinned, while the threads that wait on collectives
  (gloo, the coordination service) stop queueing behind the compute on its
  core. Measured on 2 processes over the loopback (2026-12-05): a batch-1
  ResNet call with 8 collectives took a median 12-19 ms pinned (10th
  percentile 2-8 ms), 2.0-2.3 ms released.

  Example:
    >>> pin_to_core(0)
    >>> release_threads()
    >>> os.sched_getaffinity(0)  # the calling thread stays
    {0}
    >>> os.sched_setaffinity(0, range(os.cpu_count()))
  """
  every = set(range(os.cpu_count()))
  me = threading.get_native_id()
  for task in os.listdir("/proc/self/task"):
    try:
      with open(f"/proc/self/task/{task}/comm") as comm:
        compute = comm.read().startswith("tf_XLAEigen")
      if int(task) != me and not compute:
        os.sched_setaffinity(int(task), every)
    except (FileNotFoundError, ProcessLookupError):  # a thread that ended
      continue


def define_flags() -> None:
  """The flags every experiment has: `--quiet`."""
  flags.DEFINE_bool(
    "quiet", False, "Print no progress lines, only errors and results."
  )


def define_out(required: bool = True) -> None:
  """`--out`: the output folder. A path that names a file, or one under a
  file, is a usage error while parsing (it once failed at the first write,
  after the whole run)."""
  flags.DEFINE_string("out", None, "Output folder.", required=required)
  flags.register_validator(
    "out",
    lambda path: path is None or _can_be_folder(path),
    message="--out must name a folder (or where one can be made), not a "
    "file or a path under a file",
  )


def _can_be_folder(path: str) -> bool:
  """Whether `path` is a folder, or its nearest existing parent is one."""
  path = os.path.abspath(path)
  while not os.path.exists(path):
    path = os.path.dirname(path)
  return os.path.isdir(path)


def define_piper_budget() -> None:
  """`--piper_budget`: the stages (down-set pairs) Piper may price before
  it reports that it found no plan (`graphpipe.plan`'s `piper_budget`)."""
  from graphpipe.planning.piper import PIPER_BUDGET

  flags.DEFINE_integer(
    "piper_budget",
    PIPER_BUDGET,
    "Stages (down-set pairs) Piper may price before it gives up.",
    lower_bound=1,
  )


def check_int_list(name: str, minimum: int = 1) -> None:
  """Makes list flag `--name` a usage error unless it holds integers >=
  `minimum` (a bad value then stops the app before it starts)."""

  def ok(values) -> bool:
    try:
      return all(int(v) >= minimum for v in values)
    except ValueError:
      return False

  flags.register_validator(
    name,
    ok,
    message=f"--{name} takes integers >= {minimum}, separated by commas",
  )


def check_choices(name: str, allowed) -> None:
  """Makes list flag `--name` a usage error unless each value is allowed."""
  allowed = tuple(allowed)
  flags.register_validator(
    name,
    lambda values: values is None or set(values) <= set(allowed),
    message=f"--{name} takes values of: {', '.join(allowed)}",
  )


def start(argv) -> None:
  """The first line of every experiment's `main`: arguments and logging.

  Refuses positional arguments, applies `--quiet`, and keeps JAX's start-up
  chatter (the probe for accelerators that are not there) out of the
  output.
  """
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  quiet = flags.FLAGS["quiet"].value if "quiet" in flags.FLAGS else False
  logging.set_verbosity(logging.WARNING if quiet else logging.INFO)
  # The accelerator probe logs at WARNING on machines without one.
  std_logging.getLogger("jax._src.xla_bridge").setLevel(std_logging.ERROR)


def log(text: str) -> None:
  """One progress line (absl logging; silenced by `--quiet`)."""
  logging.info(text)


class Progress:
  """Progress of a loop of known length: where it is, elapsed, remaining.

  Example:
    >>> progress = Progress(3, "epoch")
    >>> for epoch in range(3):
    ...   progress.step(f"loss {0.1:.3f}")   # 'epoch 1/3: loss 0.100 ...'

  Args:
    total: the number of steps.
    what: what one step is called ('step', 'epoch', 'sweep point', ...).
    every: log every `every`-th step (and the last); for fast loops.
    say: where the lines go (default `log`; a no-op on the processes of a
      multi-process run that are not the leader).
  """

  def __init__(self, total: int, what: str = "step", every: int = 1, say=None):
    self.total = max(1, int(total))
    self.what = what
    self.every = max(1, int(every))
    self.say = say or log
    self.done = 0
    self.begin = time.perf_counter()

  def step(self, note: str = "") -> None:
    """Marks one more step done and logs it (every `every` steps)."""
    self.done += 1
    if self.done % self.every and self.done < self.total:
      return
    elapsed = time.perf_counter() - self.begin
    left = elapsed / self.done * (self.total - self.done)
    timing = f"{_seconds(elapsed)} elapsed"
    if self.done < self.total:
      timing += f", ~{_seconds(left)} left"
    text = f"{self.what} {self.done}/{self.total}"
    self.say(f"{text}: {note} ({timing})" if note else f"{text} ({timing})")


def _seconds(value: float) -> str:
  if value < 120:
    return f"{value:.1f} s"
  return f"{value / 60:.1f} min"


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
      cwd=os.path.dirname(os.path.abspath(__file__)),
    ).stdout.strip()
  except (OSError, subprocess.SubprocessError):
    commit = None
  return {
    "python": sys.version.split()[0],
    "platform": platform.platform(),
    "cpu_count": os.cpu_count(),
    "cpu_affinity": sorted(os.sched_getaffinity(0)),
    "jax": jax.__version__,
    "numpy": numpy.__version__,
    "backend": jax.default_backend(),
    "devices": [str(d) for d in jax.devices()],
    "xla_flags": os.environ.get("XLA_FLAGS", ""),
    "git_commit": commit,
    "time_utc": datetime.datetime.now(datetime.UTC).isoformat(),
  }


def write_results(out: str, results: dict, name: str = "results.json") -> str:
  """Writes `results` (plus `environment` if absent) as JSON under `out`.

  Strict JSON: a figure that is not a finite number (a diverged loss, an
  unbounded time) is written as null, which every JSON reader takes
  (Python's default `NaN` / `Infinity` are not JSON).

  Example:
    >>> write_results("/tmp/run", {"ratio": 1.2, "loss": float("nan")})
    '/tmp/run/results.json'

    writes {"ratio": 1.2, "loss": null, "environment": {...}}.

  Args:
    out: the output folder (created).
    results: a JSON-ready dict.
    name: the file name.

  Returns:
    The path written.
  """
  os.makedirs(out, exist_ok=True)
  results.setdefault("environment", environment())
  path = os.path.join(out, name)
  with open(path, "w") as f:
    json.dump(_strict(results), f, indent=1, allow_nan=False)
  return path


def _strict(value):
  """`value` with every float that is not finite replaced by None."""
  if isinstance(value, dict):
    return {k: _strict(v) for k, v in value.items()}
  if isinstance(value, list | tuple):
    return [_strict(v) for v in value]
  if isinstance(value, float) and not math.isfinite(value):
    return None
  return value


# Two-sided 95% quantiles of Student's t for 1-30 degrees of freedom, and
# the normal quantile beyond (enough for seed counts).
_T95 = (
  12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
  2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
  2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip


def paired_interval(a: list[float], b: list[float]) -> dict:
  """Mean of a - b over paired seeds and its two-sided 95% t interval.

  >>> r = paired_interval([0.9, 0.8, 0.85], [0.8, 0.8, 0.8])
  >>> round(r["mean"], 4), r["seeds"]
  (0.05, 3)
  >>> round(r["low"], 4), round(r["high"], 4)
  (-0.0742, 0.1742)
  """
  if len(a) != len(b):
    raise ValueError(f"unpaired: {len(a)} against {len(b)} seeds")
  diffs = [x - y for x, y in zip(a, b, strict=True)]
  n = len(diffs)
  mean = sum(diffs) / n
  if n < 2:
    return {"mean": mean, "low": None, "high": None, "seeds": n}
  sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (n - 1))
  t = _T95[n - 2] if n - 2 < len(_T95) else 1.960
  half = t * sd / math.sqrt(n)
  return {"mean": mean, "low": mean - half, "high": mean + half, "seeds": n}


def plan_summary(plan, report) -> dict:
  """The headline figures of a planned and simulated configuration.

  Args:
    plan: a `graphpipe.Plan`.
    report: its `graphpipe.Report` (from `graphpipe.simulate`).
  """
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
