"""What the graphpipe bad-input tests share: a tiny three-layer MLP, its
graph, plan, trainer and files (`Ctx`, built once per test module), and
the edits that make bad graph files, weights and batches.

The cases themselves are rows of docs/guide/bad_input.md's table ("Bad input,
everywhere"): `test_bad_input.py` (capture, graph and plan files, plan,
simulate) and `test_bad_input_runtime.py` (Trainer, checkpoints).
"""

import json
import os

import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import graphpipe

BATCH = {"x": np.ones((16, 4), np.float32), "y": np.zeros((16, 1), np.float32)}


def mlp(width=8, dtype=jnp.float32):
  return nnx.Sequential(
    nnx.Linear(4, width, param_dtype=dtype, rngs=nnx.Rngs(0)),
    nnx.Linear(width, 8, rngs=nnx.Rngs(1)),
    nnx.Linear(8, 1, rngs=nnx.Rngs(2)),
  )


def loss_fn(m, b):
  return jnp.mean((m(b["x"]) - b["y"]) ** 2)


class Ctx:
  """The graph, plan, trainer and files the cases share (built once)."""

  def __init__(self, folder):
    self.folder = str(folder)
    self.graph = graphpipe.capture(loss_fn, mlp(), BATCH)
    self.plan = graphpipe.tightest_plan(self.graph, 2, 16)
    self.trainer = graphpipe.Trainer(
      self.plan, optax.sgd(0.1), graph=self.graph
    )
    self.graph_file = os.path.join(self.folder, "graph.json")
    self.graph.save(self.graph_file)
    self.plan_file = os.path.join(self.folder, "plan.json")
    self.plan.save(self.plan_file)

  def state(self, model=None):
    return self.trainer.init(model or mlp())

  def edited(self, path, edit, name):
    """A copy of JSON file `path` with `edit(data)` applied."""
    with open(path) as f:
      data = json.load(f)
    data = edit(data) or data
    out = os.path.join(self.folder, name)
    with open(out, "w") as f:
      json.dump(data, f)
    return out

  def truncated(self, path, name):
    with open(path) as f:
      text = f.read()
    out = os.path.join(self.folder, name)
    with open(out, "w") as f:
      f.write(text[: len(text) // 2])
    return out

  def checkpoint(self, name):
    folder = os.path.join(self.folder, name)
    self.trainer.save(self.state(), folder)
    return folder


def set_node(field, value):
  def edit(data):
    data["nodes"][0][field] = value

  return edit


def add_edge(src, dst):
  def edit(data):
    data["edges"].append(
      {"src": src, "dst": dst, "bytes": 4, "fixed_bytes": 0, "num_values": 1}
    )

  return edit


def nan_weights():
  model = mlp()
  kernel = model.layers[0].kernel
  kernel[...] = kernel[...].at[0, 0].set(jnp.nan)
  return model


def with_leaf(name, value):
  return dict(BATCH, **{name: value})


def rewrite(path, edit):
  with open(path) as f:
    data = json.load(f)
  edit(data)
  with open(path, "w") as f:
    json.dump(data, f)


def truncate_file(path):
  with open(path, "rb") as f:
    raw = f.read()
  with open(path, "wb") as f:
    f.write(raw[: len(raw) // 2])
