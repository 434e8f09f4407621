"""The paper model zoo and its registry.

Every model module (`mmt`, `dlrm`, `candle_uno`, `two_branch`,
`transformer`, `two_tower`) provides a frozen `Config` with `paper()` and
`tiny()`, an NNX `Model(config, *, rngs)`, `loss_fn(model, batch)`,
`make_batch(config, batch_size, seed)` and `abstract_batch(config,
batch_size)`. The registry names them:

  spec = models.get("mmt")
  cfg = models.config("mmt", "tiny")
  model = models.build("mmt", cfg)
  loss = spec.loss_fn(model, spec.make_batch(cfg, 4))

Module layout, which `graphpipe.capture` turns into operator nodes: the root
model calls each branch (depth 1) once, and each branch calls its layers
(depth 2) one after another, so at `capture_depth` every layer of every
branch is one node. Heads sit at depth 1 (one layer) or hold their layers at
depth 2; concatenation, pooling and the loss are glue in the root.
"""

import contextlib
import dataclasses
import math
from collections.abc import Callable

import jax
from flax import nnx

from graphpipe.core.graph import OpGraph
from graphpipe.errors import ModelConfigError
from graphpipe.frontend.tracer import capture
from graphpipe.models import (
  candle_uno,
  dlrm,
  mmt,
  transformer,
  two_branch,
  two_tower,
)

NAMES = (
  "mmt",
  "dlrm",
  "candle_uno",
  "two_branch",
  "transformer",
  "two_tower",
)

SIZES = ("paper", "tiny")


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  """Everything the experiments need to know about one zoo model.

  Example:
    >>> spec = get("dlrm")
    >>> spec.capture_depth, spec.default_batch_size
    (2, 128)

  Args:
    name: the registry name.
    config_cls: the model's frozen `Config` dataclass.
    model_cls: the NNX model class, `model_cls(config, rngs=...)`.
    loss_fn: `loss_fn(model, batch) -> scalar`.
    make_batch: `make_batch(config, batch_size, seed=0) -> dict`.
    abstract_batch: `abstract_batch(config, batch_size) -> dict` of
      `jax.ShapeDtypeStruct`.
    capture_depth: module depth at which each layer is one operator node.
    default_batch_size: global mini-batch for the paper config (our choice;
      the paper gives no table).
    scale_batch: whether experiments scale the default batch with the
      device count (the throughput sweeps) or keep it (the case study).
  """

  name: str
  config_cls: type
  model_cls: type
  loss_fn: Callable
  make_batch: Callable
  abstract_batch: Callable
  capture_depth: int
  default_batch_size: int
  scale_batch: bool = True


def _spec(
  name: str, module, default_batch_size: int, scale_batch: bool = True
) -> ModelSpec:
  return ModelSpec(
    name=name,
    config_cls=module.Config,
    model_cls=module.Model,
    loss_fn=module.loss_fn,
    make_batch=module.make_batch,
    abstract_batch=module.abstract_batch,
    capture_depth=2,
    default_batch_size=default_batch_size,
    scale_batch=scale_batch,
  )


# Transformers take 64 sequences of 256 tokens (16k tokens a step); the
# MLP models have far less work per sample and take 128.
_SPECS = {
  spec.name: spec
  for spec in (
    _spec("mmt", mmt, 64),
    _spec("dlrm", dlrm, 128),
    _spec("candle_uno", candle_uno, 128),
    # The case study's batch, from the paper's own numbers: half of
    # GraphPipe's 20% gain comes from the shorter warm-up, sequential
    # running micro-batches of 2 through 8 stages and GraphPipe micro-
    # batches of 4 through a depth-4 pipeline. Per sample, warm-up costs
    # (B/2 + 7)/(B/2) against (B/4 + 3)/(B/4); their ratio is 1.1 at B = 8.
    _spec("two_branch", two_branch, 8, scale_batch=False),
    _spec("transformer", transformer, 64),
    _spec("two_tower", two_tower, 128),
  )
}


def get(name: str) -> ModelSpec:
  """The registry entry of model `name`.

  Example:
    >>> get("candle_uno").config_cls.paper().num_branches
    7

  Args:
    name: one of `NAMES`.

  Raises:
    ModelConfigError: `name` is not a zoo model.
  """
  try:
    return _SPECS[name]
  except KeyError:
    raise ModelConfigError(
      f"unknown model {name!r}; known models: {', '.join(NAMES)}"
    ) from None


def config(name: str, size: str = "paper"):
  """The `paper` or `tiny` config of model `name`.

  Example:
    >>> config("mmt", "tiny").num_branches
    4

  Args:
    name: one of `NAMES`.
    size: "paper" (the evaluation sizes) or "tiny" (CPU-test sizes).
  """
  spec = get(name)
  if size not in SIZES:
    raise ModelConfigError(
      f"unknown config size {size!r} for {name!r}; use one of {SIZES}"
    )
  return getattr(spec.config_cls, size)()


def build(name: str, config, *, seed: int = 0, abstract: bool = False):
  """Model `name` built from `config`, with real or abstract weights.

  `abstract=True` traces the constructor with `nnx.eval_shape`, so every
  parameter is a `jax.ShapeDtypeStruct` and nothing is allocated: the paper
  DLRM holds 7 tables of 1M rows.

  Example:
    >>> model = build("dlrm", config("dlrm"), abstract=True)
    >>> model.sparse[0].table.shape
    (1000000, 64)

  Args:
    name: one of `NAMES`.
    config: an instance of the model's `Config`.
    seed: seed of the weight initialisation.
    abstract: build shapes only.
  """
  spec = get(name)
  if not isinstance(config, spec.config_cls):
    raise ModelConfigError(
      f"build({name!r}, ...) needs a {spec.config_cls.__module__}.Config, "
      f"got {type(config).__module__}.{type(config).__name__}; "
      f"see graphpipe.models.config({name!r}, 'tiny')"
    )

  def make():
    return spec.model_cls(config, rngs=nnx.Rngs(seed))

  if not abstract:
    return make()
  with _cheap_sharding_probes():
    return nnx.eval_shape(make)


@contextlib.contextmanager
def _cheap_sharding_probes():
  """Within: reading `.sharding` of a traced value raises its
  AttributeError without JAX's note on where the value came from.

  Flax probes `getattr(value, 'sharding', None)` each time a traced
  variable is written (`nnx.Variable.set_value`: every `rngs.params()`
  bumps a count), and the note JAX builds for that AttributeError scans
  every equation traced so far: quadratic in the model's size (the paper
  MMT's abstract build took 4.0 s, 0.65 s without). The probe drops the
  message, so nothing is lost; other tracer errors keep their notes.
  """
  tracer = jax.core.Tracer
  original = tracer.__dict__.get("sharding")
  if not isinstance(original, property):  # another JAX: leave it be
    yield
    return

  def sharding(self):
    raise AttributeError("a traced value has no 'sharding'")

  tracer.sharding = property(sharding)
  try:
    yield
  finally:
    tracer.sharding = original


def num_params(model: nnx.Module) -> int:
  """Number of trainable parameters of a real or abstract model.

  Example:
    >>> num_params(build("candle_uno", config("candle_uno"), abstract=True))
    532807681

  Args:
    model: an NNX module.
  """
  leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
  return sum(math.prod(leaf.shape) for leaf in leaves)


# Devices per Summit node: the unit the paper's 4 to 32 GPU sweep scales by.
NODE_SIZE = 4


def default_batch_size(name: str, num_devices: int) -> int:
  """The mini-batch of model `name` on `num_devices` devices.

  The zoo's `default_batch_size` is the mini-batch of one 4-GPU Summit
  node, and larger runs scale it with the device count as the paper's 4 to
  32 GPU sweep does (weak scaling): B = default x max(N, 4) / 4. The
  two-branch case study is one fixed configuration (B = 8).

  Example:
    >>> default_batch_size("mmt", 16)      # zoo default 64 per 4 devices
    256

  Args:
    name: one of `NAMES`.
    num_devices: devices the plan may use.
  """
  spec = get(name)
  if not spec.scale_batch:  # the case study: one fixed configuration
    return spec.default_batch_size
  return spec.default_batch_size * max(num_devices, NODE_SIZE) // NODE_SIZE


def capture_zoo(
  name: str,
  size: str = "tiny",
  batch_size: int | None = None,
  granularity=None,
  costs: bool = True,
  split_layers: dict[str, int] | None = None,
) -> OpGraph:
  """Captures zoo model `name` at size `size` on abstract weights.

  Example:
    >>> graph = capture_zoo("candle_uno", "paper")
    >>> len(graph.sources())
    7

  Args:
    name: one of `NAMES`.
    size: 'paper' or 'tiny'.
    batch_size: batch size to trace at; per-sample figures do not depend on
      it (default 8).
    granularity: as in `graphpipe.capture`; default the model's depth.
    costs: measure per-node FLOPs and bytes.
    split_layers: as in `graphpipe.capture`: layers cut by output
      features into parts, each its own node ({'head.layers.0': 4}).
  """
  spec = get(name)
  cfg = config(name, size)
  if batch_size is None:
    batch_size = 8
  # 0 is not "the default": it was taken for one, silently.
  if isinstance(batch_size, bool) or not isinstance(batch_size, int):
    raise ModelConfigError(f"batch_size must be an int, got {batch_size!r}")
  if batch_size < 1:
    raise ModelConfigError(f"batch_size must be >= 1, got {batch_size}")
  model = build(name, cfg, abstract=True)
  batch = spec.abstract_batch(cfg, batch_size)
  return capture(
    spec.loss_fn,
    model,
    batch,
    granularity=(spec.capture_depth if granularity is None else granularity),
    costs=costs,
    split_layers=split_layers,
    name=name,
    config=size,
  )
