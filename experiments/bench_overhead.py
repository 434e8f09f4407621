"""What the pipelined runtime costs beyond the arithmetic it runs.

  python -m experiments.bench_overhead --out=/tmp/overhead
  python -m experiments.bench_overhead --smoke --out=/tmp/overhead  # seconds

Each row trains one model with a `graphpipe.Trainer` and with plain JAX
doing the same arithmetic in the same order, alternating step by step in
one process (SGD, the same micro-batches, the same initial weights):

- 1F1B: a jitted step whose `lax.scan` over the micro-batches accumulates
  `jax.value_and_grad` of each micro-batch's weighted loss;
- GPipe: `jax.value_and_grad` of a `lax.scan` over the micro-batches, which
  like GPipe keeps every micro-batch's residuals, then runs all backwards.

`ratio` is the median of the per-pair ratios ours / plain. One-device rows
run a one-stage plan in this process, pinned to one core before JAX starts
(XLA's flags alone leave a CPU device multi-threaded, see JAX_NOTES.md):
one stage has no transfers and no bubble, so the ratio is the runtime's
overhead. Two-device rows run a two-stage plan (the chain cut in half) in
two processes pinned to two cores (`graphpipe.runtime.launch`, gloo over
loopback); plain JAX runs on one device in each, so their `ratio` includes
the pipeline's speed-up and bubble. `ideal_step_s` is what a tick-by-tick
runtime without overheads would take: every tick lasts as long as its
slowest action, a stage's forward of one micro-batch takes the plain
forward time / (stages x micro-batches), its backward the rest of the plain
step likewise; `overhead` = ours / ideal (on one device the ideal is plain
JAX itself). Every row also checks the arithmetic: the losses of all steps
and the final parameters of the two systems must agree (`loss_rel_diff`,
`param_rel_error`).

`empty_tick_s` is the cost of one tick where nothing runs, per device
count: the same plan with idle ticks appended to its schedule, minus the
plain schedule, over the number of idle ticks.
"""

import dataclasses
import json
import os
import statistics
import sys
import time

from absl import app, flags

from experiments import common
from experiments.overhead_models import (
  MLP_LAYERS,
  Case,
  build,
  chain_plan,
  plain_steps,
)

if __name__ == "__main__":
  # One core per process, chosen before JAX starts so that XLA sizes its
  # thread pool to it; launched children take the core of their id.
  if "GRAPHPIPE_PROCESS_ID" in os.environ:
    common.pin_to_core(int(os.environ["GRAPHPIPE_PROCESS_ID"]))
  else:
    common.pin_to_core(common.int_flag_from_argv("core", 0))

SCHEDULES = ("1f1b", "gpipe")


def define_flags():
  """This experiment's flags (`experiments.gpu_check` reuses them)."""
  common.define_flags()
  flags.DEFINE_list("mlp_widths", ["512", "1024"], "Widths of the tanh MLP.")
  flags.DEFINE_list("mlp_batch_sizes", ["256", "512"], "MLP batch sizes.")
  flags.DEFINE_list("microbatches", ["4", "8"], "Micro-batch counts (MLP).")
  flags.DEFINE_list(
    "transformers",
    ["tiny:64:4", "mid:32:4"],
    "Transformer rows as config:batch:micro-batches; 'tiny' is the zoo's "
    "tiny config, 'mid' 4 layers of width 128 over 64 tokens.",
  )
  flags.DEFINE_list(
    "two_device_mlps",
    ["512:256:4", "1024:512:8"],
    "Two-stage MLP rows as width:batch:micro-batches ('' for none).",
  )
  flags.DEFINE_integer(
    "pairs", 15, "Timed (ours, plain) pairs per row.", lower_bound=1
  )
  flags.DEFINE_integer(
    "warmup", 2, "Untimed steps per system and row.", lower_bound=0
  )
  flags.DEFINE_integer(
    "idle_ticks",
    1024,
    "Idle ticks for the empty tick (enough that they outlast the step "
    "time's noise: with 64, a few us each, the difference was noise).",
    lower_bound=1,
  )
  flags.DEFINE_enum(
    "optimizer",
    "sgd",
    ["sgd", "adam"],
    "What both systems step with: SGD, or Adam (its update reads and "
    "writes three times the parameters' bytes: where the runtime's update "
    "of donated state costs more than plain JAX's, Adam shows it).",
  )
  flags.DEFINE_float("learning_rate", 0.05, "The optimizer's learning rate.")
  flags.DEFINE_integer("core", 0, "Core of the one-device process.")
  flags.DEFINE_bool(
    "smoke", False, "Tiny sizes and 2 pairs: checks the machinery only."
  )
  common.define_out()
  for name in ("mlp_widths", "mlp_batch_sizes", "microbatches"):
    common.check_int_list(name)
  # Bad rows failed mid-run (a traceback after the rows before them were
  # measured): refused while parsing.
  flags.register_validator(
    "transformers",
    lambda specs: all(_row_ok(s, ("tiny", "mid")) for s in specs),
    message="--transformers takes config:batch:micro-batches rows, config "
    "tiny or mid, the micro-batch count dividing the batch",
  )
  flags.register_validator(
    "two_device_mlps",
    lambda specs: all(not s or _row_ok(s) for s in specs),
    message="--two_device_mlps takes width:batch:micro-batches rows, the "
    "micro-batch count dividing the batch",
  )
  flags.register_multi_flags_validator(
    ["mlp_batch_sizes", "microbatches"],
    lambda given: all(
      b.isdigit() and m.isdigit() and int(m) >= 1 and int(b) % int(m) == 0
      for b in given["mlp_batch_sizes"]
      for m in given["microbatches"]
    ),
    message="every --microbatches count must divide every --mlp_batch_sizes",
  )


def _row_ok(spec: str, configs=None) -> bool:
  """Whether a `first:batch:micro-batches` row is well formed (`first` one
  of `configs`, or a width >= 1 when None)."""
  parts = spec.split(":")
  if len(parts) != 3 or not all(p.isdigit() for p in parts[1:]):
    return False
  first, batch, micro = parts[0], int(parts[1]), int(parts[2])
  if configs is None:
    ok = first.isdigit() and int(first) >= 1
  else:
    ok = first in configs
  return ok and micro >= 1 and batch % micro == 0


def alternate(systems: dict, pairs: int, warmup: int) -> dict:
  """Runs each system's step in turn; per system its times and losses."""
  out = {name: {"times": [], "losses": []} for name in systems}
  for i in range(warmup + pairs):
    for name, step in systems.items():
      start = time.perf_counter()
      loss = step()
      elapsed = time.perf_counter() - start
      if loss is not None:
        out[name]["losses"].append(loss)
      if i >= warmup:
        out[name]["times"].append(elapsed)
  return out


def max_rel_error(got: dict, want: dict) -> float:
  import numpy as np

  return max(
    float(np.max(np.abs(np.asarray(got[k]) - np.asarray(want[k]))))
    / (float(np.max(np.abs(np.asarray(want[k])))) + 1e-12)
    for k in want
  )


def replicated(trainer, batch):
  """The batch put on the trainer's devices once, so steps move no data."""
  return trainer.put_batch(batch)


def make_optimizer(options):
  """The optax optimizer `--optimizer` names, at `--learning_rate`."""
  import optax

  return getattr(optax, options.optimizer)(options.learning_rate)


def measure_row(case: Case, schedule: str, num_stages: int, options) -> dict:
  """One row: ours and plain, alternating (see the module docstring)."""
  import jax

  from graphpipe import Trainer, capture

  model, loss_fn, batch = build(case)
  graph = capture(
    loss_fn,
    model,
    {k: v[:8] for k, v in batch.items()},
    granularity=2,
    name=case.model,
  )
  optimizer = make_optimizer(options)
  plan = chain_plan(graph, case, num_stages, schedule)
  trainer = Trainer(plan, optimizer, graph=graph)
  state = trainer.init(model)
  reference = plain_steps(model, loss_fn, case, optimizer, graph)
  ours_batch = replicated(trainer, batch)
  plain_batch = jax.device_put(batch, jax.local_devices()[0])
  plain_step, forward = reference["steps"][schedule], reference["forward"]
  holder = {
    "ours": state,
    "plain": (reference["params"], reference["opt_state"]),
  }

  def ours():
    holder["ours"], metrics = trainer.step(holder["ours"], ours_batch)
    return metrics["loss"]

  def plain():
    p, o, loss = plain_step(*holder["plain"], plain_batch)
    holder["plain"] = (p, o)
    return float(loss)

  def plain_forward():
    float(forward(holder["plain"][0], plain_batch))

  systems = {"ours": ours, "plain": plain}
  if num_stages > 1:
    systems["forward"] = plain_forward
  timed = alternate(systems, options.pairs, options.warmup)
  ours_t, plain_t = timed["ours"]["times"], timed["plain"]["times"]
  if num_stages > 1:
    ideal = [
      lockstep_time(trainer.schedule, f, p - f)
      for f, p in zip(timed["forward"]["times"], plain_t, strict=True)
    ]
  else:
    ideal = plain_t
  losses_ours, losses_plain = (
    timed["ours"]["losses"],
    timed["plain"]["losses"],
  )
  return {
    "model": case.model,
    "schedule": schedule,
    "devices": num_stages,
    "batch_size": case.batch_size,
    "micro_batches": case.microbatches,
    "ours_step_s": statistics.median(ours_t),
    "plain_step_s": statistics.median(plain_t),
    "ratio": statistics.median(
      o / p for o, p in zip(ours_t, plain_t, strict=True)
    ),
    "ideal_step_s": statistics.median(ideal),
    "overhead": statistics.median(
      o / i for o, i in zip(ours_t, ideal, strict=True)
    ),
    "loss_ours": losses_ours[-1],
    "loss_plain": losses_plain[-1],
    "loss_rel_diff": max(
      abs(a - b) / abs(b)
      for a, b in zip(losses_ours, losses_plain, strict=True)
    ),
    "param_rel_error": max_rel_error(
      trainer.params(holder["ours"]),
      reference["values"](holder["plain"][0]),
    ),
  }


def lockstep_time(schedule, forward_s: float, backward_s: float) -> float:
  """A zero-overhead tick-by-tick step: each tick its slowest action.

  `forward_s` and `backward_s` are the whole model's forward and backward
  over all micro-batches; each stage's action gets an equal share.
  """
  shares = schedule.num_stages * schedule.num_microbatches
  cost = {"F": forward_s / shares, "B": backward_s / shares}
  return sum(
    max((cost[row[t].kind] for row in schedule.grid if row[t]), default=0.0)
    for t in range(schedule.num_ticks)
  )


def empty_tick(case: Case, num_stages: int, options) -> float:
  """Seconds of one idle tick (see the module docstring)."""
  from graphpipe import Trainer, capture

  model, loss_fn, batch = build(case)
  graph = capture(
    loss_fn,
    model,
    {k: v[:8] for k, v in batch.items()},
    granularity=2,
    name=case.model,
  )
  plan = chain_plan(graph, case, num_stages, "1f1b")
  base = Trainer(plan, make_optimizer(options), graph=graph)
  schedule = base.schedule
  padded = dataclasses.replace(
    schedule,
    grid=tuple(row + (None,) * options.idle_ticks for row in schedule.grid),
  )
  longer = Trainer(plan, make_optimizer(options), graph=graph, schedule=padded)
  states = {"base": base.init(model), "longer": longer.init(model)}
  data = replicated(base, batch)

  def stepper(name, trainer):
    def step():
      states[name], metrics = trainer.step(states[name], data)
      return metrics["loss"]

    return step

  timed = alternate(
    {"base": stepper("base", base), "longer": stepper("longer", longer)},
    options.pairs,
    options.warmup,
  )
  return statistics.median(
    (long - short) / options.idle_ticks
    for long, short in zip(
      timed["longer"]["times"], timed["base"]["times"], strict=True
    )
  )


def cases(options):
  """(one-device cases, two-device cases) from the flags."""
  one = [
    Case(f"mlp{w}", int(b), int(m))
    for w in options.mlp_widths
    for b in options.mlp_batch_sizes
    for m in options.microbatches
  ]
  for spec in options.transformers:
    config, batch_size, microbatches = spec.split(":")
    one.append(
      Case(f"transformer-{config}", int(batch_size), int(microbatches))
    )
  two = []
  for spec in options.two_device_mlps:
    if spec:
      width, batch_size, microbatches = spec.split(":")
      two.append(Case(f"mlp{width}", int(batch_size), int(microbatches)))
  return one, two


def refuse_with_smoke(names) -> None:
  """A usage error when a flag --smoke sets was given with it (it would be
  overwritten without a word)."""
  given = [f"--{n}" for n in names if flags.FLAGS[n].present]
  if given:
    raise app.UsageError(
      f"--smoke sets {', '.join(given)} itself: leave them out, or --smoke"
    )


# The flags --smoke sets.
SMOKE_FLAGS = (
  "mlp_widths",
  "mlp_batch_sizes",
  "microbatches",
  "transformers",
  "two_device_mlps",
  "pairs",
  "warmup",
  "idle_ticks",
)


def apply_smoke(options):
  """Tiny sizes and few pairs: seconds, for tests."""
  options.mlp_widths = ["32"]
  options.mlp_batch_sizes = ["16"]
  options.microbatches = ["2"]
  options.transformers = ["tiny:8:2"]
  options.two_device_mlps = ["32:16:2"]
  options.pairs = 2
  options.warmup = 2
  options.idle_ticks = 4


def measure(cases_, num_stages: int, options, say) -> dict:
  """Rows of `cases_` on `num_stages` devices, and the empty tick."""
  rows = []
  progress = common.Progress(len(cases_) * len(SCHEDULES), "row", say=say)
  for case in cases_:
    for schedule in SCHEDULES:
      row = measure_row(case, schedule, num_stages, options)
      progress.step(
        f"{num_stages} dev {case.model} B={case.batch_size} "
        f"m={case.microbatches} {schedule}: ours "
        f"{row['ours_step_s'] * 1e3:.1f} ms, plain "
        f"{row['plain_step_s'] * 1e3:.1f} ms, ratio {row['ratio']:.3f}, "
        f"overhead {row['overhead']:.3f}"
      )
      rows.append(row)
  tick = empty_tick(cases_[0], num_stages, options) if cases_ else None
  return {"rows": rows, "empty_tick_s": tick}


def main(argv):
  common.start(argv)
  import jax

  from graphpipe.runtime.launch import initialize_from_env, launch

  options = flags.FLAGS
  if options.smoke:
    refuse_with_smoke(SMOKE_FLAGS)
    apply_smoke(options)
  one, two = cases(options)
  if initialize_from_env():
    leader = jax.process_index() == 0
    say = common.log if leader else (lambda *a, **k: None)
    part = measure(two, 2, options, say)
    if leader:
      print("RESULT " + json.dumps(part), flush=True)
    return
  load_before = os.getloadavg()
  common.log(f"pinned to cores {sorted(os.sched_getaffinity(0))}")
  results = measure(one, 1, options, common.log)
  rows = results["rows"]
  empty_tick_s = {"1": results["empty_tick_s"]}
  if two:
    outputs = launch(
      ["-m", "experiments.bench_overhead", *sys.argv[1:]],
      2,
      1,
      timeout=7200,
    )
    lines = outputs[0].splitlines()
    for text in lines:
      if not text.startswith("RESULT "):
        sys.stderr.write(text + "\n")
    line = [x for x in lines if x.startswith("RESULT ")]
    part = json.loads(line[-1][len("RESULT ") :])
    rows += part["rows"]
    empty_tick_s["2"] = part["empty_tick_s"]
  results = {
    "config": {
      "mlp_layers": MLP_LAYERS,
      "pairs": options.pairs,
      "warmup": options.warmup,
      "idle_ticks": options.idle_ticks,
      "optimizer": options.optimizer,
      "learning_rate": options.learning_rate,
      "smoke": options.smoke,
      "xla_flags": os.environ.get("XLA_FLAGS", ""),
    },
    "rows": rows,
    "empty_tick_s": empty_tick_s,
    "load_average": {"before": load_before, "after": os.getloadavg()},
    "setup": "one-device rows: this process pinned to one core; two-device "
    "rows: 2 processes x 1 CPU device, each pinned to its own core",
    "environment": common.environment(),
  }
  common.write_results(options.out, results)
  for row in rows:
    print(
      f"{row['devices']} dev {row['model']:16s} {row['schedule']:5s} "
      f"B={row['batch_size']:4d} m={row['micro_batches']}: ratio "
      f"{row['ratio']:.3f} overhead {row['overhead']:.3f}"
    )
  print(f"empty tick: {empty_tick_s}")


if __name__ == "__main__":
  define_flags()
  app.run(main)
