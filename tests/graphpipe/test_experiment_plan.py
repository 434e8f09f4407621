"""End-to-end runs of experiments.plan and experiments.compare_planners.

Each runs the absl app in a subprocess on tiny zoo configs, as a user would.
"""

import json
import os
import pathlib
import subprocess
import sys
import types

import pytest

import graphpipe
from graphpipe import Plan
from graphpipe.core.memory import KINDS
from graphpipe.errors import PlanError
from graphpipe.models import capture_zoo

ROOT = pathlib.Path(__file__).resolve().parents[2]
RESULT_KEYS = {
  "planner",
  "num_devices",
  "num_stages",
  "depth",
  "micro_batch_size",
  "num_microbatches",
  "iteration_time_s",
  "throughput_samples_per_s",
  "peak_memory_bytes",
  "bubble_fraction",
  "search_time_s",
  "config",
  "environment",
}


def _run(module, *args):
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  return subprocess.run(
    [sys.executable, "-m", module, *args],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=600,
  )


def test_plan_writes_every_output(tmp_path):
  done = _run(
    "experiments.plan",
    "--model=two_branch",
    "--config=tiny",
    "--num_devices=4",
    "--planner=graphpipe",
    "--device=v100",
    "--max_padding=0.05",
    f"--out={tmp_path}",
  )
  assert done.returncode == 0, done.stderr[-3000:]
  assert "[4/4] wrote" in done.stdout + done.stderr
  results = json.loads((tmp_path / "results.json").read_text())
  assert RESULT_KEYS <= set(results)
  assert results["planner"] == "graphpipe"
  assert results["num_devices"] == 4
  # No --batch_size: the zoo default for one 4-device node.
  assert results["config"]["batch_size_source"] == "default"
  assert results["throughput_samples_per_s"] > 0
  assert 0 <= results["bubble_fraction"] < 1
  # No plan is faster than the floor; this one is not below it.
  assert 0 < results["iteration_floor_s"] <= results["iteration_time_s"]
  assert results["iteration_floor_node"]
  # As the runtime steps it: tick by tick, with slot-sized gradient adds.
  assert results["runtime_iteration_time_s"] >= results["iteration_time_s"]
  trace = json.loads((tmp_path / "trace.json").read_text())
  assert any(e["ph"] == "X" for e in trace["traceEvents"])
  schedule = json.loads((tmp_path / "schedule.json").read_text())
  assert schedule["num_microbatches"] == results["num_microbatches"]
  assert (tmp_path / "plan.json").exists()
  # What each device will hold, by kind, from the runtime's own layout.
  assert results["memory_source"] == "runtime"
  memory = results["memory_per_device"]
  assert len(memory) == 4
  assert all(set(kinds) == set(KINDS) for kinds in memory)
  plan = Plan.load(str(tmp_path / "plan.json"))
  graph = capture_zoo("two_branch", "tiny")
  largest_stage = max(
    sum(graph.nodes[n].param_bytes for n in s.nodes) for s in plan.stages
  )
  assert all(kinds["parameters"] == largest_stage for kinds in memory)
  own, held = (
    results["param_optimizer_bytes_own"],
    results["param_optimizer_bytes_held"],
  )
  padding = sum(h - o for h, o in zip(held, own, strict=True)) / sum(held)
  assert results["padding_fraction"] == pytest.approx(padding)
  assert 0 <= results["padding_fraction"] <= 0.05
  assert results["config"]["max_padding"] == 0.05
  # The planner's bound is never below the runtime's figure.
  for mine, bound in zip(
    memory, results["planner_memory_per_device"], strict=True
  ):
    assert sum(bound.values()) >= sum(mine.values())
  pytest.importorskip("matplotlib")
  assert (tmp_path / "schedule.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(
  "flag,message",
  [
    ("--planner=nope", "flag --planner=nope: value should be one of"),
    ("--model=nope", "flag --model=nope: value should be one of"),
    ("--device=tpu9", "flag --device=tpu9: value should be one of"),
  ],
)
def test_plan_refuses_bad_input_with_the_package_error(tmp_path, flag, message):
  done = _run("experiments.plan", "--config=tiny", f"--out={tmp_path}", flag)
  assert done.returncode != 0
  assert message in done.stderr
  assert "Traceback" not in done.stderr


def test_compare_planners_writes_ratios(tmp_path):
  done = _run(
    "experiments.compare_planners",
    "--models=two_branch,candle_uno",
    "--devices=4,8",
    "--config=tiny",
    "--device=v100",
    f"--out={tmp_path}",
  )
  assert done.returncode == 0, done.stderr[-3000:]
  assert "configuration 12/12" in done.stderr  # progress, with timing
  assert "elapsed" in done.stderr
  results = json.loads((tmp_path / "results.json").read_text())
  assert len(results["rows"]) == 2 * 2 * 3
  pairs = {(r["model"], r["num_devices"]) for r in results["ratios"]}
  assert pairs == {(m, n) for m in ("two_branch", "candle_uno") for n in (4, 8)}
  speed = {
    (r["model"], r["num_devices"], r["planner"]): r for r in results["rows"]
  }
  for ratio in results["ratios"]:
    key = (ratio["model"], ratio["num_devices"])
    ours, base = (
      speed[(*key, p)]["throughput_samples_per_s"]
      for p in ("graphpipe", "sequential")
    )
    assert ratio["graphpipe_over_sequential"] == pytest.approx(ours / base)
  # A row is the simulated throughput of the planner's plan.
  row = speed[("two_branch", 4, "graphpipe")]
  graph = capture_zoo("two_branch", "tiny")
  p = graphpipe.plan(graph, 4, row["batch_size"], device="v100")
  report = graphpipe.simulate(p, graph)
  assert row["throughput_samples_per_s"] == pytest.approx(
    report.throughput_samples_per_s, rel=1e-6
  )
  pytest.importorskip("matplotlib")
  assert (tmp_path / "ratio.png").exists()


def test_the_experiments_give_piper_its_budget(tmp_path):
  # Piper's no-plan error says "raise piper_budget": each experiment that
  # plans takes --piper_budget and hands it on (here a budget of 5 stages).
  from experiments import compare_planners, train
  from experiments import plan as plan_experiment

  priced = "it priced 5 stages"
  with pytest.raises(PlanError, match=priced):
    plan_experiment.run(
      model="two_branch",
      config="tiny",
      num_devices=4,
      batch_size=None,
      planner="piper",
      device="v100",
      out=str(tmp_path),
      plots=False,
      piper_budget=5,
    )
  rows = compare_planners.compare(
    model_names=["two_branch"],
    device_counts=[4],
    planners=["piper"],
    device="v100",
    config="tiny",
    piper_budget=5,
  )["rows"]
  assert priced in rows[0]["error"]
  graph = capture_zoo("two_branch", "tiny")
  for memory in ("tight", "preset"):  # tightest_plan, plan
    options = types.SimpleNamespace(
      memory=memory,
      config="tiny",
      num_devices=4,
      batch_size=8,
      planner="piper",
      device="v100",
      piper_budget=5,
    )
    with pytest.raises(PlanError, match=priced):
      train.make_plan(graph, options)
    options.piper_budget = 10**6  # the default plans it
    assert train.make_plan(graph, options).planner == "piper"


def test_compare_planners_draws_no_empty_chart(tmp_path):
  # Without graphpipe (or sequential) among the planners there is no
  # ratio: no chart, and the run says why (it drew empty axes before).
  from experiments import compare_planners

  rows = [
    {"model": "mmt", "num_devices": 4, "planner": p}
    | {"throughput_samples_per_s": 1.0}
    for p in ("sequential", "gpipe")
  ]
  ratios = compare_planners.ratios(rows)
  said = compare_planners.write_plot(str(tmp_path), ratios, "v100")
  assert "needs both" in said
  assert not (tmp_path / "ratio.png").exists()
  pytest.importorskip("matplotlib")
  rows.append(rows[0] | {"planner": "graphpipe"})
  ratios = compare_planners.ratios(rows)
  said = compare_planners.write_plot(str(tmp_path), ratios, "v100")
  assert said == f"wrote {tmp_path / 'ratio.png'}"
  assert (tmp_path / "ratio.png").read_bytes()[:4] == b"\x89PNG"
