"""experiments.gpu_check --smoke: the GPU check's code paths on CPU."""

import json
import math
import os
import subprocess
import sys

import pytest

from experiments import gpu_check
from graphpipe.errors import CostModelError
from tests.child_env import child_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))


def test_detect_preset():
  assert gpu_check.detect_preset("NVIDIA H200", "gpu") == "h200"
  assert gpu_check.detect_preset("Tesla V100-SXM2-16GB", "gpu") == "v100"
  assert gpu_check.detect_preset("cpu", "cpu") == "cpu"
  with pytest.raises(CostModelError, match="--preset"):
    gpu_check.detect_preset("NVIDIA L4", "gpu")


def test_node_ids_spread_over_the_graph():
  assert gpu_check.node_ids(5, 10) == [0, 1, 2, 3, 4]
  ids = gpu_check.node_ids(100, 5)
  assert ids[0] == 0 and ids[-1] == 99 and len(ids) == 5


def test_gpu_check_smoke(tmp_path):
  env = child_env()  # one CPU device, as on a one-GPU machine
  env["JAX_PLATFORMS"] = "cpu"
  out = subprocess.run(
    [sys.executable, "-m", "experiments.gpu_check", "--smoke"]
    + [f"--out={tmp_path}", "--quiet"],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  assert "INFO" not in out.stderr  # --quiet
  with open(tmp_path / "results.json") as f:
    results = json.load(f)
  assert results["preset"] == "cpu" and results["skipped"] == []
  nodes = results["nodes"]
  # 3 nodes x 2 sizes x forward and backward, each beside the preset.
  assert len(nodes["rows"]) == 12
  for row in nodes["rows"]:
    assert row["measured_s"] > 0 or row["kind"] == "bwd"
    assert row["analytic_s"]["float32"] > 0
  assert {(s["batch"], s["kind"]) for s in nodes["summary"]} == {
    (b, k) for b in (1, 2) for k in ("fwd", "bwd")
  }
  for s in nodes["summary"]:
    assert 0 < s["p10"] <= s["median"] <= s["p90"] < math.inf
  (fit,) = nodes["fit"]
  # The preset is on the grid: the fit can only explain the times better.
  assert fit["fitted"]["rms_log_error"] <= fit["preset"]["rms_log_error"]
  rows = results["overhead"]["rows"]
  assert {r["schedule"] for r in rows} == {"1f1b", "gpipe"}
  for row in rows:
    assert row["devices"] == 1
    assert row["loss_rel_diff"] < 1e-5 and row["param_rel_error"] < 1e-5
    assert 0 < row["ratio"] < math.inf
  assert math.isfinite(results["tick"]["empty_tick_s"])


@pytest.mark.parametrize(
  "given, message",
  [
    # --smoke set them over what was asked, without a word.
    (["--smoke", "--models=mmt"], "--smoke sets --models itself"),
    (["--smoke", "--pairs=5"], "--smoke sets --pairs itself"),
    # A dtype the preset does not price was dropped: no fit at all.
    (["--preset=v100", "--dtypes=bfloat16"], "not dtypes of the v100"),
  ],
)
def test_flags_that_would_be_dropped_are_usage_errors(tmp_path, given, message):
  env = child_env()
  env["JAX_PLATFORMS"] = "cpu"
  out = subprocess.run(
    [sys.executable, "-m", "experiments.gpu_check", *given]
    + [f"--out={tmp_path}"],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert out.returncode != 0 and message in out.stderr, out.stderr[-2000:]
  assert "Traceback" not in out.stderr
