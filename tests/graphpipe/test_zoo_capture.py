"""Capture of every zoo model: exact evaluation, XLA FLOPs, paper structure."""

import jax
import numpy as np
import pytest
from flax import nnx

from graphpipe import models
from graphpipe.models import capture_zoo


def branch_lengths(graph):
  """Length of the chain hanging from each source, in nodes."""
  lengths = []
  for node in graph.sources():
    length = 1
    while len(graph.successors(node)) == 1:
      nxt = graph.successors(node)[0]
      if len(graph.predecessors(nxt)) != 1:
        break
      node, length = nxt, length + 1
    lengths.append(length)
  return sorted(lengths)


@pytest.mark.parametrize("name", models.NAMES)
def test_tiny_node_by_node_equals_loss_and_xla_flops(name):
  spec = models.get(name)
  cfg = models.config(name, "tiny")
  model = models.build(name, cfg, seed=1)
  batch = spec.make_batch(cfg, 4, seed=2)
  graph = capture_zoo(name, "tiny", batch_size=4)
  expected = spec.loss_fn(model, batch)
  np.testing.assert_allclose(
    graph.evaluate(model, batch), expected, rtol=1e-6, atol=1e-7
  )
  graphdef, state = nnx.split(model)
  whole = jax.jit(lambda s, b: spec.loss_fn(nnx.merge(graphdef, s), b))
  xla = whole.lower(state, batch).compile().cost_analysis()["flops"]
  ours = sum(n.cost("fwd_flops", 4) for n in graph.nodes)
  assert ours == pytest.approx(xla, rel=0.02)
  owned = [p for n in graph.nodes for p in n.params]
  assert (
    len(owned)
    == len(set(owned))
    == len(jax.tree.leaves(nnx.state(model, nnx.Param)))
  )


def test_paper_structure():
  # Structure only (costs=False): the cost figures are tested above.
  candle = capture_zoo("candle_uno", "paper", costs=False)
  assert branch_lengths(candle) == [4] * 7
  mmt = capture_zoo("mmt", "paper", costs=False)
  assert branch_lengths(mmt) == [8] * 4
  dlrm = capture_zoo("dlrm", "paper", costs=False)
  assert branch_lengths(dlrm) == [1] * 7 + [4] * 7
  chain = capture_zoo("transformer", "paper", costs=False)
  assert len(chain.sources()) == 1
  assert all(len(chain.successors(n.id)) <= 1 for n in chain.nodes)
  two = capture_zoo("two_branch", "paper", costs=False)
  assert branch_lengths(two) == [4, 4]
  towers = capture_zoo("two_tower", "paper", costs=False)
  assert len(towers.loss_nodes) == 2 and len(towers.sources()) == 2
  assert not any(
    set(towers.successors(a)) & set(towers.successors(b))
    for a, b in [towers.sources()]
  )
