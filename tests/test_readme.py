"""The README's Python example runs as written."""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(__file__))


def test_readme_example_runs(tmp_path):
  with open(os.path.join(ROOT, "README.md")) as f:
    text = f.read()
  code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
  # What the example shows must also be true: the node-by-node loss is the
  # model's, the saved graph loads back, the plan is valid, the step's loss
  # is plain JAX's at the initial weights, and the model got new weights.
  code += CHECKS
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)  # the example sets its own
  out = subprocess.run(
    [sys.executable, "-c", code],
    cwd=tmp_path,
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert out.returncode == 0, out.stderr[-3000:]
  assert "samples/s" in out.stdout
  assert "README CHECKS PASSED" in out.stdout, out.stdout[-3000:]


CHECKS = """
import jax
import jax.numpy as _jnp
import numpy as _np
from flax import nnx as _nnx

_fresh = models.build("two_branch", cfg)
_want = float(spec.loss_fn(_fresh, batch))
assert abs(float(graph.evaluate(_fresh, batch)) - _want) <= 1e-5 * abs(_want)
assert abs(float(metrics["loss"]) - _want) <= 1e-5 * abs(_want), (
  metrics["loss"], _want)
_loaded = graphpipe.OpGraph.load("graph.json")
assert [n.name for n in _loaded.nodes] == [n.name for n in graph.nodes]
graphpipe.check_plan(plan, graph, float("inf"))
_before = _nnx.state(_fresh, _nnx.Param)
_after = _nnx.state(model, _nnx.Param)
_moved = max(
  float(_jnp.max(_jnp.abs(a - b)))
  for a, b in zip(jax.tree.leaves(_after), jax.tree.leaves(_before))
)
assert _moved > 0, "update_model left the weights unchanged"
print("README CHECKS PASSED")
"""
