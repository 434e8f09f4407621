"""Real branch concurrency on this machine: graphpipe vs sequential plans.

  python -m experiments.bench_runtime --out=/tmp/bench

Two single-threaded CPU devices that truly run in parallel: two processes
(one JAX CPU device each, `graphpipe.runtime.launch`, gloo over loopback),
each pinned to its own core before JAX starts. (On jax 0.10.2 the XLA flags
that should make one CPU device single-threaded do not: a device still keeps
~1.7 cores busy, so two devices in one process would share both cores.)
They train a two-tower multi-task model (two branches reading the same
input, each ending in its own loss, losses summed: no join). The graphpipe
plan puts one tower on each device (depth 1); the sequential plan chains the
same two stages (depth 2), as a sequential pipeline must. Both run the same
number of micro-batches through the same runtime, alternating step by step;
measured_ratio is the median of (sequential / graphpipe) step-time pairs
(measured_ratios, one per pair).
predicted_ratio is the simulator's for the same plans, with node times
profiled on one pinned core and the runtime's tick-by-tick execution
(lockstep, with the slot-sized gradient add of every backward timed on
the core), transfers priced with the loopback collective latency measured
in the same run; the asynchronous-pipeline prediction is reported beside it.

Defaults: towers of 4 layers of 512 over a 256-wide input, batch 1024 in 4
micro-batches of 256. Smaller batches leave the per-step costs both plans
share (optimizer, host transfer, loss all-reduce) a larger part of the step
and shrink the measured ratio (docs/guide/training.md lists a sweep).
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
  flags.DEFINE_integer("hidden", 512, "Tower layer width.", lower_bound=1)
  flags.DEFINE_integer("tower_layers", 4, "Layers per tower.", lower_bound=1)
  flags.DEFINE_integer(
    "batch_size",
    1024,
    "Samples per step (large enough that compute, not the per-step "
    "optimizer and host costs, dominates; docs/guide/training.md has "
    "smaller).",
    lower_bound=1,
  )
  flags.DEFINE_integer(
    "microbatches", 4, "Micro-batches per step.", lower_bound=1
  )
  # Not divisible, the plans took batch // microbatches samples each and
  # ran another number of micro-batches than asked, silently.
  flags.register_multi_flags_validator(
    ["batch_size", "microbatches"],
    lambda given: given["batch_size"] % given["microbatches"] == 0,
    message="--microbatches must divide --batch_size",
  )
  flags.DEFINE_integer(
    "pairs", 30, "Timed (sequential, graphpipe) pairs.", lower_bound=1
  )
  common.define_out()


def tower_plans(graph, batch_size, microbatches):
  """(graphpipe, sequential) plans: one tower per device, unchained/chained."""
  from graphpipe.core.stages import Plan, Stage, in_flight_counts

  component = {}
  for node in graph.nodes:
    preds = graph.predecessors(node.id)
    component[node.id] = (
      component[preds[0]] if preds else len(set(component.values()))
    )
  towers = sorted({c for c in component.values()})
  if len(towers) != 2:
    raise ValueError(f"expected two towers, found {len(towers)} components")
  nodes = [tuple(n for n, c in component.items() if c == t) for t in towers]
  micro = batch_size // microbatches
  plans = []
  for name, edges in (("graphpipe", ()), ("sequential", ((0, 1),))):
    counts = in_flight_counts(2, edges)
    stages = tuple(Stage(i, nodes[i], (i,), micro, counts[i]) for i in range(2))
    plans.append(Plan(name, stages, edges, batch_size, 2, device="cpu"))
  return plans


def main(argv):
  common.start(argv)
  if pinned.relaunch("experiments.bench_runtime"):
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
  plans = dict(
    zip(
      ("graphpipe", "sequential"),
      tower_plans(graph, options.batch_size, options.microbatches),
      strict=True,
    )
  )
  leader, say = pinned.start()
  batch = two_tower.make_batch(cfg, options.batch_size, seed=0)
  graphs = dict.fromkeys(plans, graph)
  trainers, states = pinned.warm(
    plans, graphs, optax.sgd(1e-3), model, batch, say
  )
  order = ("sequential", "graphpipe")
  times = pinned.timed_pairs(trainers, states, batch, options.pairs, order, say)
  ratios = [
    s / g for s, g in zip(times["sequential"], times["graphpipe"], strict=True)
  ]
  latency = pinned.link_latency()
  if not leader:
    return
  micro = options.batch_size // options.microbatches
  spec = pinned.cpu_spec(latency)
  costs = pinned.cost_model(graph, spec, (micro // 2, micro, 2 * micro))
  predicted = {}
  for name, plan in plans.items():
    predicted[name] = {
      "lockstep": simulate(plan, graph, costs, lockstep=True).iteration_time_s,
      "async": simulate(plan, graph, costs).iteration_time_s,
    }
  results = {
    "config": {
      "model": "two_tower",
      "in_features": cfg.in_features,
      "hidden": cfg.hidden,
      "tower_layers": cfg.tower_layers,
      "batch_size": options.batch_size,
      "microbatches": options.microbatches,
      "pairs": options.pairs,
      "xla_flags": os.environ.get("XLA_FLAGS", ""),
    },
    "measured_ratio": statistics.median(ratios),
    "measured_ratios": ratios,
    "predicted_ratio": predicted["sequential"]["lockstep"]
    / predicted["graphpipe"]["lockstep"],
    "predicted_ratio_async": predicted["sequential"]["async"]
    / predicted["graphpipe"]["async"],
    "measured_step_time_s": pinned.medians(times),
    "predicted_step_time_s": {n: p["lockstep"] for n, p in predicted.items()},
    "predicted_step_time_async_s": {
      n: p["async"] for n, p in predicted.items()
    },
    "depth": {n: p.depth for n, p in plans.items()},
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
          "predicted_ratio_async",
          "measured_step_time_s",
          "predicted_step_time_s",
        )
      },
      indent=1,
    )
  )


if __name__ == "__main__":
  define_flags()
  app.run(main)
