"""A layer split across two real devices, measured against the simulator.

  python -m experiments.bench_split --out=/tmp/bench_split

The same two pinned single-core CPU devices as `bench_runtime` (two
processes, gloo over loopback). The model is a wide layer and a small
classifier head; two plans on the two devices, alternating step by step:

  whole  the wide layer on device 0, the head on device 1 (a two-stage
         pipeline whose first stage does almost all the work)
  split  the model captured with the wide layer in 2 parts
         (`capture(..., split_layers={'wide': 2})`): one part on device 1,
         the other part, the concatenation and the head on device 0

measured_ratio is the median of (whole / split) step-time pairs;
predicted_ratio the simulator's for the same plans (lockstep, node times
and the gradient adds of every backward profiled on one pinned core,
transfers priced with the loopback latency measured in the same run).
Each plan's measured step beside its simulated step says whether the
simulator prices a split layer's stages as they run.

Defaults: 1024 inputs, a wide layer of 4096, 10 classes, batch 512 in 4
micro-batches of 128.
"""

import json
import os
import statistics

from absl import app, flags

from experiments import common, pinned

if __name__ == "__main__" and "GRAPHPIPE_PROCESS_ID" in os.environ:
  # Pin before JAX starts, so XLA sizes its thread pool to this one core.
  common.pin_to_core(int(os.environ["GRAPHPIPE_PROCESS_ID"]))

PLANS = ("whole", "split")


def define_flags():
  """This experiment's flags (defined when run, so tests import freely)."""
  common.define_flags()
  flags.DEFINE_integer("in_features", 1024, "Input width.", lower_bound=1)
  flags.DEFINE_integer("wide", 4096, "The wide layer's width.", lower_bound=2)
  flags.DEFINE_integer("batch_size", 512, "Samples per step.", lower_bound=1)
  flags.DEFINE_integer(
    "microbatches", 4, "Micro-batches per step.", lower_bound=1
  )
  flags.register_multi_flags_validator(
    ["batch_size", "microbatches"],
    lambda given: given["batch_size"] % given["microbatches"] == 0,
    message="--microbatches must divide --batch_size",
  )
  flags.DEFINE_integer(
    "pairs", 20, "Timed (whole, split) pairs.", lower_bound=1
  )
  common.define_out()


def two_stage_plan(graph, name, first, batch_size, microbatches):
  """A plan of two stages: nodes `first(node name)` on device 1 feeding
  the rest on device 0 ('split'), or on device 0 feeding the rest on
  device 1 ('whole')."""
  from graphpipe.core.stages import Plan, Stage, in_flight_counts

  head = tuple(n.id for n in graph.nodes if first(n.name))
  rest = tuple(n.id for n in graph.nodes if not first(n.name))
  devices = ((1,), (0,)) if name == "split" else ((0,), (1,))
  micro = batch_size // microbatches
  counts = in_flight_counts(2, ((0, 1),))
  stages = (
    Stage(0, head, devices[0], micro, counts[0]),
    Stage(1, rest, devices[1], micro, counts[1]),
  )
  return Plan(name, stages, ((0, 1),), batch_size, 2, device="cpu")


def main(argv):
  common.start(argv)
  if pinned.relaunch("experiments.bench_split"):
    return
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax
  from flax import nnx

  from graphpipe import capture
  from graphpipe.simulator.engine import simulate

  options = flags.FLAGS

  class Model(nnx.Module):
    def __init__(self, rngs):
      self.wide = nnx.Linear(options.in_features, options.wide, rngs=rngs)
      self.head = nnx.Linear(options.wide, 10, rngs=rngs)

    def __call__(self, x):
      return self.head(jax.nn.relu(self.wide(x)))

  def loss_fn(model, batch):
    logits = model(batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(
      logits, batch["y"]
    ).mean()

  model = Model(nnx.Rngs(0))
  rng = np.random.default_rng(0)
  batch = {
    "x": rng.standard_normal((options.batch_size, options.in_features)).astype(
      np.float32
    ),
    "y": rng.integers(0, 10, options.batch_size).astype(np.int32),
  }
  abstract = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct((8, *x.shape[1:]), x.dtype), batch
  )
  graphs = {
    "whole": capture(loss_fn, model, abstract, name="wide"),
    "split": capture(
      loss_fn, model, abstract, split_layers={"wide": 2}, name="wide split"
    ),
  }
  plans = {
    "whole": two_stage_plan(
      graphs["whole"],
      "whole",
      lambda n: n == "wide",
      options.batch_size,
      options.microbatches,
    ),
    "split": two_stage_plan(
      graphs["split"],
      "split",
      lambda n: n == "wide#1of2",
      options.batch_size,
      options.microbatches,
    ),
  }
  leader, say = pinned.start()
  trainers, states = pinned.warm(
    plans, graphs, optax.sgd(1e-3), model, batch, say
  )
  # Both plans train the same model: the split one within float error.
  same = float(
    jnp.max(
      jnp.abs(
        trainers["split"].params(states["split"])["param:head.kernel"]
        - trainers["whole"].params(states["whole"])["param:head.kernel"]
      )
    )
  )
  times = pinned.timed_pairs(trainers, states, batch, options.pairs, PLANS, say)
  ratios = [w / s for w, s in zip(times["whole"], times["split"], strict=True)]
  latency = pinned.link_latency()
  if not leader:
    return
  micro = options.batch_size // options.microbatches
  spec = pinned.cpu_spec(latency)
  predicted = {}
  for name in PLANS:
    costs = pinned.cost_model(
      graphs[name],
      spec,
      (micro // 2, micro, 2 * micro),
      # (The fastest of 3 calls varied the prediction by 20% run to run.)
      repeats=10,
    )
    predicted[name] = simulate(
      plans[name], graphs[name], costs, lockstep=True
    ).iteration_time_s
  measured = pinned.medians(times)
  results = {
    "config": {
      "in_features": options.in_features,
      "wide": options.wide,
      "batch_size": options.batch_size,
      "microbatches": options.microbatches,
      "pairs": options.pairs,
      "xla_flags": os.environ.get("XLA_FLAGS", ""),
    },
    "measured_ratio": statistics.median(ratios),
    "measured_ratios": ratios,
    "predicted_ratio": predicted["whole"] / predicted["split"],
    "measured_step_time_s": measured,
    "predicted_step_time_s": predicted,
    "measured_over_predicted": {n: measured[n] / predicted[n] for n in PLANS},
    "head_kernel_max_difference": same,
    "cpu_spec": spec.source,
    "collective_latency_s": latency,
    "load_average": os.getloadavg()[0],
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
          "measured_over_predicted",
          "head_kernel_max_difference",
        )
      },
      indent=1,
    )
  )


if __name__ == "__main__":
  define_flags()
  app.run(main)
