"""The models and the plain-JAX reference of `experiments.bench_overhead`.

`build` makes a row's model, loss and batch (a tanh MLP chain or a zoo
transformer), `chain_plan` cuts its node chain into equal stages, and
`plain_steps` is plain JAX doing the same arithmetic in the same order as
the runtime's one-stage step, for both schedules.
"""

import dataclasses

from graphpipe.errors import ModelConfigError

MLP_LAYERS = 8


@dataclasses.dataclass(frozen=True)
class Case:
  """One benchmarked configuration.

  Attributes:
    model: 'mlp<width>', 'transformer-tiny' or 'transformer-mid'.
    batch_size: samples per step.
    microbatches: micro-batches per step.
  """

  model: str
  batch_size: int
  microbatches: int


def build(case: Case, seed: int = 0):
  """(model, loss_fn, numpy batch) of `case`."""
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx

  from graphpipe import models
  from graphpipe.models import transformer

  if case.model.startswith("mlp"):
    width = int(case.model[3:])

    class TanhLayer(nnx.Module):
      def __init__(self, rngs):
        self.linear = nnx.Linear(width, width, rngs=rngs)

      def __call__(self, x):
        return jnp.tanh(self.linear(x))

    class TanhChain(nnx.Module):
      def __init__(self, rngs):
        self.layers = nnx.List([TanhLayer(rngs) for _ in range(MLP_LAYERS)])

      def __call__(self, x):
        for layer in self.layers:
          x = layer(x)
        return x

    def loss_fn(model, batch):
      return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)

    rng = np.random.default_rng(seed)
    batch = {
      k: rng.standard_normal((case.batch_size, width), dtype=np.float32)
      for k in ("x", "y")
    }
    return TanhChain(nnx.Rngs(seed)), loss_fn, batch
  spec = models.get("transformer")
  if case.model == "transformer-tiny":
    cfg = models.config("transformer", "tiny")
  elif case.model == "transformer-mid":
    cfg = transformer.Config(
      num_layers=4,
      seq_len=64,
      hidden=128,
      num_heads=4,
      ffn=512,
      num_classes=10,
    )
  else:
    raise ModelConfigError(f"unknown model {case.model!r}")
  model = models.build("transformer", cfg, seed=seed)
  return model, spec.loss_fn, spec.make_batch(cfg, case.batch_size, seed=seed)


def chain_plan(graph, case: Case, num_stages: int, schedule: str):
  """A plan cutting the node chain into `num_stages` equal runs."""
  from graphpipe.core.stages import Plan, Stage, in_flight_counts

  ids = sorted(n.id for n in graph.nodes)
  edges = tuple((s, s + 1) for s in range(num_stages - 1))
  counts = in_flight_counts(num_stages, edges)
  micro = case.batch_size // case.microbatches
  size = -(-len(ids) // num_stages)
  stages = tuple(
    Stage(s, tuple(ids[s * size : (s + 1) * size]), (s,), micro, counts[s])
    for s in range(num_stages)
  )
  return Plan(
    "manual",
    stages,
    edges,
    case.batch_size,
    num_stages,
    schedule=schedule,
    device="cpu",
  )


def plain_steps(model, loss_fn, case: Case, optimizer, graph) -> dict:
  """Plain JAX: initial 'params' and 'opt_state', jitted 'steps' by
  schedule, the 'forward' loss over all micro-batches, and 'values', which
  maps plain parameters to the runtime's 'param:' keys (via `graph`).
  """
  import jax
  import jax.numpy as jnp
  from flax import nnx

  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  weight = 1.0 / case.microbatches  # each micro-batch's share of the mean

  def loss_of(p, microbatch):
    return loss_fn(nnx.merge(graphdef, p, rest), microbatch) * weight

  def split(batch):
    return jax.tree.map(
      lambda x: x.reshape((case.microbatches, -1) + x.shape[1:]), batch
    )

  def update(params, opt_state, grads):
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return jax.tree.map(jnp.add, params, updates), opt_state

  def one_f_one_b(params, opt_state, batch):
    def body(carry, microbatch):
      loss, grads = carry
      value, grad = jax.value_and_grad(loss_of)(params, microbatch)
      return (loss + value, jax.tree.map(jnp.add, grads, grad)), None

    zero = (jnp.zeros(()), jax.tree.map(jnp.zeros_like, params))
    (loss, grads), _ = jax.lax.scan(body, zero, split(batch))
    return *update(params, opt_state, grads), loss

  def total_loss(params, batch):
    def body(loss, microbatch):
      return loss + loss_of(params, microbatch), None

    return jax.lax.scan(body, jnp.zeros(()), split(batch))[0]

  def gpipe(params, opt_state, batch):
    loss, grads = jax.value_and_grad(total_loss)(params, batch)
    return *update(params, opt_state, grads), loss

  steps = {
    "1f1b": jax.jit(one_f_one_b, donate_argnums=(0, 1)),
    "gpipe": jax.jit(gpipe, donate_argnums=(0, 1)),
  }

  def values(p):
    merged = nnx.merge(graphdef, p, rest)
    return {
      k: v
      for k, v in graph.program.variable_values(merged).items()
      if k.startswith("param:")
    }

  # Committed to the device from the start: the first step's outputs are,
  # and inputs that differ in placement would compile the step twice.
  params = jax.device_put(params, jax.local_devices()[0])
  return {
    "params": params,
    "opt_state": optimizer.init(params),
    "steps": steps,
    "forward": jax.jit(total_loss),
    "values": values,
  }
