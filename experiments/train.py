"""Train a zoo model with a pipeline plan: the project's main job.

  python -m experiments.train --model=two_branch --config=tiny \\
    --num_devices=8 --planner=graphpipe --steps=3 --verify --out=/tmp/train

Captures the model, plans it (graphpipe, sequential or gpipe), builds the
pipelined step and trains on synthetic batches, printing each step's loss.
Writes DIR/results.json: loss (per step), compile_time_s, first_step_s,
step_time_s (median of the steps after the first; null for one step),
samples_per_s, peak_memory_bytes (per device), the plan and, with
--verify, verify_max_rel_error (loss and every gradient of the first step
against jax.value_and_grad of the unpipelined model on one device).

Without accelerators it runs on N simulated CPU devices (the flag
--xla_force_host_platform_device_count is set from --num_devices before JAX
starts). --num_processes=P starts P local processes of N/P devices each.
"""

import statistics
import sys
import time

from absl import app, flags

from experiments import common

if (
  __name__ == "__main__" and common.int_flag_from_argv("num_processes", 1) == 1
):
  common.use_cpu_devices(common.int_flag_from_argv("num_devices", 8))


def define_flags():
  """This experiment's flags (defined when run, so tests import freely)."""
  from graphpipe import PLANNERS, models
  from graphpipe.costs.analytic import PRESETS

  common.define_flags()
  flags.DEFINE_enum("model", "two_branch", models.NAMES, "Zoo model.")
  flags.DEFINE_enum("config", "tiny", models.SIZES, "Model size.")
  flags.DEFINE_integer("num_devices", 8, "Devices in the mesh.", lower_bound=1)
  flags.DEFINE_integer(
    "num_processes", 1, "Local processes (N/P devices each).", lower_bound=1
  )
  flags.DEFINE_integer(
    "timeout",
    3600,
    "With --num_processes > 1: seconds the processes may run before they "
    "are stopped and the run fails.",
    lower_bound=1,
  )
  flags.DEFINE_enum("planner", "graphpipe", PLANNERS, "Planner.")
  common.define_piper_budget()
  flags.DEFINE_integer("steps", 5, "Optimizer steps.", lower_bound=1)
  flags.DEFINE_integer("batch_size", 16, "Samples per step.", lower_bound=1)
  flags.DEFINE_enum(
    "device", "v100", PRESETS, "Cost-model preset for planning."
  )
  flags.DEFINE_string(
    "memory",
    "auto",
    "Per-device budget for planning: 'auto' (tightest that fits for tiny "
    "configs, so they really pipeline; the preset's capacity for paper), "
    "'preset', or bytes.",
  )
  flags.register_validator(
    "memory",
    _memory_ok,
    message="--memory takes auto, preset, tight or a number of bytes > 0",
  )
  flags.DEFINE_enum("optimizer", "adam", ("adam", "sgd"), "Optimizer.")
  flags.DEFINE_float("learning_rate", 1e-3, "Learning rate.", lower_bound=0)
  flags.DEFINE_bool("recompute", False, "Recompute forwards in the backward.")
  flags.DEFINE_bool("verify", False, "Check loss and gradients vs one device.")
  common.define_out()


def _memory_ok(value: str) -> bool:
  if value in ("auto", "preset", "tight"):
    return True
  try:
    return float(value) > 0
  except ValueError:
    return False


def make_plan(graph, options):
  """The plan the flags ask for."""
  from graphpipe import plan, tightest_plan

  memory = options.memory
  if memory == "auto":
    memory = "tight" if options.config == "tiny" else "preset"
  if memory == "tight":
    return tightest_plan(
      graph,
      options.num_devices,
      options.batch_size,
      options.planner,
      options.device,
      piper_budget=options.piper_budget,
    )
  return plan(
    graph,
    options.num_devices,
    options.batch_size,
    planner=options.planner,
    device=options.device,
    memory_bytes=None if memory == "preset" else float(memory),
    piper_budget=options.piper_budget,
  )


def verify(trainer, spec, model, batch, graph) -> float:
  """Max relative error of pipelined loss and gradients vs one device."""
  import jax
  import numpy as np
  from flax import nnx

  loss, grads = trainer.loss_and_grads(trainer.init(model), batch)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  with jax.default_device(jax.devices()[0]):
    want_loss, want = jax.value_and_grad(
      lambda p: spec.loss_fn(nnx.merge(graphdef, p, rest), batch)
    )(params)
  want = graph.program.variable_values(nnx.merge(graphdef, want, rest))
  errors = [abs(loss - float(want_loss)) / max(abs(float(want_loss)), 1e-12)]
  for key, value in grads.items():
    ref = np.asarray(want[key])
    errors.append(
      float(np.max(np.abs(value - ref))) / (float(np.max(np.abs(ref))) + 1e-12)
    )
  return max(errors)


def train(options) -> dict:
  import jax
  import optax

  from graphpipe import Trainer, models

  spec = models.get(options.model)
  cfg = models.config(options.model, options.config)
  graph = models.capture_zoo(options.model, options.config, batch_size=4)
  plan = make_plan(graph, options)
  if jax.process_index() == 0:
    common.log(str(plan))
  optimizer = {"adam": optax.adam, "sgd": optax.sgd}[options.optimizer](
    options.learning_rate
  )
  trainer = Trainer(plan, optimizer, graph=graph, recompute=options.recompute)
  model = models.build(options.model, cfg, seed=0)
  state = trainer.init(model)
  first = spec.make_batch(cfg, options.batch_size, seed=0)
  memory = trainer.memory_report(state, first)
  results = {
    "model": options.model,
    "config": options.config,
    "planner": options.planner,
    "num_devices": options.num_devices,
    "num_processes": jax.process_count(),
    "batch_size": options.batch_size,
    "plan": plan.to_dict(),
    "schedule": str(trainer.schedule),
    "compile_time_s": memory["compile_time_s"],
    "peak_memory_bytes": [memory["peak_memory_bytes"]] * options.num_devices,
    "param_bytes_own": memory["param_bytes_own"],
    "param_bytes_held": memory["param_bytes_held"],
    "stash_bytes": memory["stash_bytes"],
  }
  if options.verify:
    results["verify_max_rel_error"] = verify(trainer, spec, model, first, graph)
    if jax.process_index() == 0:
      print(f"verify: max relative error {results['verify_max_rel_error']:.2e}")
  losses, times = [], []
  progress = common.Progress(options.steps, "step")
  for step in range(options.steps):
    batch = spec.make_batch(cfg, options.batch_size, seed=step)
    start = time.perf_counter()
    state, metrics = trainer.step(state, batch)
    times.append(time.perf_counter() - start)
    losses.append(metrics["loss"])
    if jax.process_index() == 0:
      progress.step(f"loss {metrics['loss']:.5f} ({times[-1] * 1e3:.1f} ms)")
  # The first step also runs what jit left for the first call; a single
  # step has no steady time to report (it once reported that one).
  steady = statistics.median(times[1:]) if len(times) > 1 else None
  results.update(
    loss=losses,
    first_step_s=times[0],
    step_time_s=steady,
    samples_per_s=options.batch_size / steady if steady else None,
  )
  return results


def main(argv):
  common.start(argv)
  options = flags.FLAGS
  from graphpipe.errors import GraphpipeError
  from graphpipe.runtime.launch import initialize_from_env, launch, leave

  if options.num_processes > 1 and not initialize_from_env():
    if options.num_devices % options.num_processes:
      raise app.UsageError(
        "--num_devices must be a multiple of --num_processes"
      )
    try:
      outputs = launch(
        ["-m", "experiments.train", *sys.argv[1:]],
        options.num_processes,
        options.num_devices // options.num_processes,
        timeout=options.timeout,
      )
    except GraphpipeError as err:
      print(f"error: {err}", file=sys.stderr)
      sys.exit(1)
    print(outputs[0], end="")
    return
  import jax

  try:
    results = train(options)
  except GraphpipeError as err:
    if jax.process_count() > 1:
      leave(f"error: {type(err).__name__}: {err}")  # no shutdown wait
    print(f"error: {err}", file=sys.stderr)
    sys.exit(1)

  if jax.process_index() == 0:
    common.write_results(options.out, results)
    steady = results["step_time_s"]
    timing = (
      f"median step {steady * 1e3:.1f} ms, "
      f"{results['samples_per_s']:.1f} samples/s"
      if steady
      else "no step time: one step also runs first-call work (--steps >= 2)"
    )
    print(
      f"{timing}, compile {results['compile_time_s']:.1f} s; wrote "
      f"{options.out}/results.json"
    )


if __name__ == "__main__":
  define_flags()
  app.run(main)
