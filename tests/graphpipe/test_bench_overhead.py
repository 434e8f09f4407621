"""experiments.bench_overhead runs end to end and checks its arithmetic."""

import json
import math
import os
import subprocess
import sys

from tests.child_env import child_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
ROW_KEYS = {
  "model",
  "schedule",
  "devices",
  "micro_batches",
  "ours_step_s",
  "plain_step_s",
  "ratio",
  "ideal_step_s",
  "overhead",
  "loss_ours",
  "loss_plain",
  "loss_rel_diff",
  "param_rel_error",
}


def test_bench_overhead_smoke(tmp_path):
  env = child_env()  # one device per process, as the bench wants
  out = subprocess.run(
    [
      sys.executable,
      "-m",
      "experiments.bench_overhead",
      "--smoke",
      f"--out={tmp_path}",
    ],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  with open(tmp_path / "results.json") as f:
    results = json.load(f)
  rows = results["rows"]
  assert {(r["devices"], r["schedule"]) for r in rows} == {
    (d, s) for d in (1, 2) for s in ("1f1b", "gpipe")
  }
  assert {r["model"] for r in rows if r["devices"] == 1} >= {
    "mlp32",
    "transformer-tiny",
  }
  for row in rows:
    assert ROW_KEYS <= set(row)
    # The runtime and plain JAX trained the same model the same way: the
    # losses of every step and the final weights agree (GPipe's plain
    # gradient sums micro-batches in the other order, hence not 0).
    assert row["loss_rel_diff"] < 1e-5, row
    assert row["param_rel_error"] < 1e-5, row
    for key in ("ours_step_s", "plain_step_s", "ideal_step_s", "ratio"):
      assert 0 < row[key] < math.inf, (key, row)
  # One device: the ideal step is plain JAX itself.
  for row in rows:
    if row["devices"] == 1:
      assert row["overhead"] == row["ratio"]
  assert set(results["empty_tick_s"]) == {"1", "2"}
  assert all(math.isfinite(t) for t in results["empty_tick_s"].values())
