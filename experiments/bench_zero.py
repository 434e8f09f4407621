"""A ZeRO-1 stage measured on this machine, against the simulator.

  python -m experiments.bench_zero --out=/tmp/bench_zero

Two single-threaded CPU devices that truly run in parallel (two processes,
each pinned to its own core before JAX starts, as `experiments.
bench_runtime`). The model is the two-tower network of `bench_runtime`
as one data-parallel stage on both devices, trained with Adam: once
replicated (every device updates all parameters after the gradient
all-reduce) and once as a ZeRO-1 stage (a reduce-scatter, each device
updates its half, an all-gather; `graphpipe.runtime.zero`). The two run
alternately, step by step; `measured_ratio` is the median of (replicated
/ ZeRO-1) step-time pairs. `predicted_*` are the simulator's step times
for the same plans (lockstep, node times and the gradient adds of every
backward profiled on one pinned core, transfers and all-reduces priced
with the loopback latency measured in the same run), and
`zero_step_error` how far the simulated ZeRO-1 step is
from the measured one (a share of the measured).
"""

import json
import os
import statistics

from absl import app, flags

from experiments import common, pinned

if __name__ == "__main__" and "GRAPHPIPE_PROCESS_ID" in os.environ:
  # Pin before JAX starts, so XLA sizes its thread pool to this one core.
  common.pin_to_core(int(os.environ["GRAPHPIPE_PROCESS_ID"]))


def define_flags():
  """This experiment's flags (defined when run, so tests import freely)."""
  common.define_flags()
  flags.DEFINE_integer("in_features", 256, "Tower input width.", lower_bound=1)
  flags.DEFINE_integer("hidden", 1024, "Tower layer width.", lower_bound=1)
  flags.DEFINE_integer("tower_layers", 4, "Layers per tower.", lower_bound=1)
  flags.DEFINE_integer("batch_size", 256, "Samples per step.", lower_bound=2)
  flags.DEFINE_integer(
    "microbatches", 2, "Micro-batches per step.", lower_bound=1
  )
  flags.register_multi_flags_validator(
    ["batch_size", "microbatches"],
    lambda given: given["batch_size"] % (2 * given["microbatches"]) == 0,
    message="2 x --microbatches must divide --batch_size (two devices)",
  )
  flags.DEFINE_integer(
    "pairs", 30, "Timed (replicated, ZeRO-1) pairs.", lower_bound=1
  )
  common.define_out()


def stage_plans(graph, batch_size, microbatches):
  """(replicated, zero1) plans: every node in one stage on devices 0, 1."""
  from graphpipe.core.stages import Plan, Stage

  nodes = tuple(n.id for n in graph.nodes)
  micro = batch_size // microbatches
  return [
    Plan(
      "manual",
      (Stage(0, nodes, (0, 1), micro, 1, sharding),),
      (),
      batch_size,
      2,
      device="cpu",
    )
    for sharding in ("replicated", "zero1")
  ]


def main(argv):
  common.start(argv)
  if pinned.relaunch("experiments.bench_zero"):
    return
  import optax
  from flax import nnx

  from graphpipe import capture
  from graphpipe.models import two_tower
  from graphpipe.simulator.engine import simulate

  options = flags.FLAGS
  cfg = two_tower.Config(
    in_features=options.in_features,
    hidden=options.hidden,
    tower_layers=options.tower_layers,
    num_classes=10,
  )
  model = two_tower.Model(cfg, rngs=nnx.Rngs(0))
  graph = capture(
    two_tower.loss_fn,
    model,
    two_tower.abstract_batch(cfg, 8),
    granularity=2,
    name="two_tower",
  )
  names = ("replicated", "zero1")
  plans = dict(
    zip(
      names,
      stage_plans(graph, options.batch_size, options.microbatches),
      strict=True,
    )
  )
  leader, say = pinned.start()
  batch = two_tower.make_batch(cfg, options.batch_size, seed=0)
  trainers, states = pinned.warm(
    plans, dict.fromkeys(names, graph), optax.adam(1e-4), model, batch, say
  )
  times = pinned.timed_pairs(trainers, states, batch, options.pairs, names, say)
  ratios = [
    r / z for r, z in zip(times["replicated"], times["zero1"], strict=True)
  ]
  latency = pinned.link_latency()
  sizes = trainers["replicated"].buffers.params.sizes
  slot_bytes = 4 * sum(sizes)  # float32 slots
  ring = pinned.ring_time(sizes)
  if not leader:
    return
  micro = options.batch_size // options.microbatches
  spec = pinned.cpu_spec(latency)
  costs = pinned.cost_model(graph, spec, (micro // 4, micro // 2, micro))
  predicted = {
    name: simulate(plan, graph, costs, lockstep=True).iteration_time_s
    for name, plan in plans.items()
  }
  # The same with the all-reduce measured as the runtime runs it.
  measured_ring = pinned.MeasuredRing(costs, slot_bytes, ring)
  predicted_ring = {
    name: simulate(plan, graph, measured_ring, lockstep=True).iteration_time_s
    for name, plan in plans.items()
  }
  measured = pinned.medians(times)
  results = {
    "config": {
      "model": "two_tower",
      "in_features": cfg.in_features,
      "hidden": cfg.hidden,
      "tower_layers": cfg.tower_layers,
      "batch_size": options.batch_size,
      "microbatches": options.microbatches,
      "pairs": options.pairs,
      "optimizer": "adam",
    },
    "param_bytes": graph.variable_bytes(range(len(graph.nodes))),
    "measured_ratio": statistics.median(ratios),
    "measured_ratios": ratios,
    "predicted_ratio": predicted["replicated"] / predicted["zero1"],
    "measured_step_time_s": measured,
    "predicted_step_time_s": predicted,
    "zero_step_error": predicted["zero1"] / measured["zero1"] - 1,
    "replicated_step_error": predicted["replicated"] / measured["replicated"]
    - 1,
    "ring_time_s": ring,
    "allreduce_priced_s": costs.allreduce_time(slot_bytes, (0, 1)),
    "predicted_step_time_measured_ring_s": predicted_ring,
    "measured_over_predicted_measured_ring": {
      name: measured[name] / predicted_ring[name] for name in names
    },
    "cpu_spec": spec.source,
    "collective_latency_s": latency,
    "setup": "2 processes x 1 CPU device, each pinned to its own core",
  }
  common.write_results(options.out, results)
  print(
    json.dumps(
      {
        k: results[k]
        for k in (
          "measured_ratio",
          "predicted_ratio",
          "measured_step_time_s",
          "predicted_step_time_s",
          "zero_step_error",
          "replicated_step_error",
          "ring_time_s",
          "allreduce_priced_s",
          "measured_over_predicted_measured_ring",
        )
      },
      indent=1,
    )
  )


if __name__ == "__main__":
  define_flags()
  app.run(main)
