"""Unknown or out-of-range flag values of every experiment are usage
errors: absl refuses them while parsing (enums, bounds, validators), so a
bad value stops the app with a message naming the flag, not a traceback
from deep inside. One child process parses every row (defining one
experiment's flags at a time); one more runs an app end to end.
(disco_train's settings are checked when built: tests/disco/test_train.py.)
"""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (experiment, bad flags, text the usage error must contain)
ROWS = [
  ("train", ["--model=resnet"], "value should be one of"),
  ("train", ["--config=huge"], "value should be one of"),
  ("train", ["--planner=magic"], "value should be one of"),
  ("train", ["--device=tpu9"], "value should be one of"),
  ("train", ["--optimizer=lion"], "value should be one of"),
  ("train", ["--num_devices=0"], "is not a positive integer"),
  ("train", ["--num_processes=0"], "is not a positive integer"),
  ("train", ["--timeout=0"], "is not a positive integer"),
  ("train", ["--steps=0"], "is not a positive integer"),
  ("train", ["--batch_size=-4"], "is not a positive integer"),
  ("train", ["--learning_rate=-1"], "is not a non-negative"),
  ("train", ["--memory=lots"], "--memory takes auto, preset, tight"),
  ("train", ["--memory=0"], "--memory takes auto, preset, tight"),
  ("train", ["--steps=three"], "invalid literal for int()"),
  ("train", ["--piper_budget=0"], "is not a positive integer"),
  ("plan", ["--model=resnet"], "value should be one of"),
  ("plan", ["--config=huge"], "value should be one of"),
  ("plan", ["--planner=magic"], "value should be one of"),
  ("plan", ["--device=tpu9"], "value should be one of"),
  ("plan", ["--num_devices=0"], "is not a positive integer"),
  ("plan", ["--batch_size=0"], "is not a positive integer"),
  ("plan", ["--piper_budget=-1"], "is not a positive integer"),
  ("plan", ["--split_layers=head"], "--split_layers takes name:parts"),
  ("plan", ["--split_layers=head:1"], "--split_layers takes name:parts"),
  ("graph", ["--model=resnet"], "value should be one of"),
  ("graph", ["--config=huge"], "value should be one of"),
  ("graph", ["--batch_size=0"], "is not a positive integer"),
  ("graph", ["--granularity=0"], "--granularity takes layer, block"),
  ("graph", ["--granularity=-1"], "--granularity takes layer, block"),
  ("compare_planners", ["--models=mmt,resnet"], "--models takes values of"),
  ("compare_planners", ["--devices=4,x"], "--devices takes integers >= 1"),
  ("compare_planners", ["--devices=0"], "--devices takes integers >= 1"),
  ("compare_planners", ["--planners=magic"], "--planners takes values of"),
  ("compare_planners", ["--device=tpu9"], "value should be one of"),
  ("compare_planners", ["--config=huge"], "value should be one of"),
  ("compare_planners", ["--piper_budget=0"], "is not a positive integer"),
  ("pipedream", ["--models=resnet"], "--models takes values of"),
  ("pipedream", ["--devices=-4"], "--devices takes integers >= 1"),
  ("pipedream", ["--device=tpu9"], "value should be one of"),
  ("reproduce", ["--config=huge"], "value should be one of"),
  ("reproduce", ["--devices=4,eight"], "--devices takes integers >= 1"),
  ("reproduce", ["--branches=0"], "--branches takes integers >= 1"),
  ("reproduce", ["--split_parts=0,2"], "--split_parts takes integers >= 1"),
  ("reproduce", ["--sweep_devices=0"], "is not a positive integer"),
  ("reproduce", ["--piper_budget=0"], "is not a positive integer"),
  ("reproduce", ["--device=tpu9"], "value should be one of"),
  ("disco_infer", ["--num_nodes=0"], "is not a positive integer"),
  ("disco_infer", ["--batch_size=0"], "is not a positive integer"),
  ("disco_infer", ["--repeats=0"], "is not a positive integer"),
  ("disco_infer", ["--message_latency=-1"], "is not a non-negative"),
  ("disco_latency", ["--rates=100,x"], "--rates takes link rates > 0"),
  ("disco_latency", ["--rates=0"], "--rates takes link rates > 0"),
  ("disco_latency", ["--batch=0"], "is not a positive integer"),
  ("disco_latency", ["--models=,"], "--models takes one or more of"),
  ("disco_latency", ["--models=resnet,vgg"], "--models takes one or more of"),
  ("disco_latency", ["--repeats=0"], "is not a positive integer"),
  ("disco_latency", ["--comm_ratio=1.5"], "is not a number in the range"),
  ("disco_latency", ["--message_latency=-1"], "is not a non-negative"),
  ("bench_runtime", ["--batch_size=0"], "is not a positive integer"),
  ("bench_runtime", ["--microbatches=0"], "is not a positive integer"),
  ("bench_runtime", ["--pairs=0"], "is not a positive integer"),
  (
    "bench_runtime",
    ["--batch_size=3", "--microbatches=2"],
    "--microbatches must divide --batch_size",
  ),
  ("bench_zero", ["--pairs=0"], "is not a positive integer"),
  ("bench_split", ["--pairs=0"], "is not a positive integer"),
  ("bench_split", ["--wide=1"], "is not integer >= 2"),
  (
    "bench_split",
    ["--batch_size=6", "--microbatches=4"],
    "--microbatches must divide --batch_size",
  ),
  (
    "bench_zero",
    ["--batch_size=6", "--microbatches=2"],
    "2 x --microbatches must divide --batch_size",
  ),
  ("bench_overhead", ["--mlp_widths=512,wide"], "integers >= 1"),
  ("bench_overhead", ["--microbatches=0"], "integers >= 1"),
  ("bench_overhead", ["--pairs=0"], "is not a positive integer"),
  ("bench_overhead", ["--warmup=-1"], "is not a non-negative"),
  ("bench_overhead", ["--transformers=tiny:64"], "config:batch:micro-batches"),
  ("bench_overhead", ["--transformers=huge:8:2"], "config tiny or mid"),
  ("bench_overhead", ["--transformers=tiny:8:3"], "dividing the batch"),
  ("bench_overhead", ["--two_device_mlps=512:256"], "width:batch:micro"),
  ("bench_overhead", ["--two_device_mlps=0:256:4"], "width:batch:micro"),
  ("bench_overhead", ["--microbatches=3"], "must divide every --mlp_batch"),
]
ROWS += [
  ("gpu_check", ["--models=resnet"], "--models takes values of"),
  ("gpu_check", ["--preset=tpu9"], "value should be one of"),
  ("gpu_check", ["--node_repeats=0"], "is not a positive integer"),
  ("gpu_check", ["--nodes_per_model=0"], "is not a positive integer"),
  ("gpu_check", ["--node_batch_sizes=0"], "integers >= 1"),
  ("gpu_check", ["--dtypes=bogus"], "--dtypes takes values of"),
]
# --out naming a file (or a path under one) once failed at the first
# write, after the whole run: every experiment refuses it while parsing.
ROWS += [
  (name, [f"--out={path}"], "--out must name a folder")
  for name in (
    "train",
    "plan",
    "graph",
    "compare_planners",
    "pipedream",
    "reproduce",
    "disco_infer",
    "disco_latency",
    "disco_settings",
    "bench_runtime",
    "bench_zero",
    "bench_split",
    "bench_overhead",
  )
  for path in (__file__, __file__ + "/below")
]

CHILD = r"""
import importlib, json, sys
from absl import flags
rows = json.loads(sys.argv[1])
out = {}
for name in dict.fromkeys(r[0] for r in rows):
  before = set(flags.FLAGS)
  module = importlib.import_module(f"experiments.{name}")
  (getattr(module, "define_flags", None) or module._define_flags)()
  # Required flags besides --out (never read: parsing only).
  base = ["prog", "--out=/tmp/unused"]
  base += {"disco_infer": ["--checkpoint=/tmp/unused"]}.get(name, [])
  flags.FLAGS(base)  # the defaults parse
  flags.FLAGS.unparse_flags()
  for i, (exp, args, _) in enumerate(rows):
    if exp != name:
      continue
    try:
      flags.FLAGS(base + args)
      out[i] = None
    except flags.Error as err:
      out[i] = f"{type(err).__name__}: {err}"
    flags.FLAGS.unparse_flags()
  for flag in set(flags.FLAGS) - before:
    delattr(flags.FLAGS, flag)
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def parsed():
  result = subprocess.run(
    [sys.executable, "-c", CHILD, json.dumps(ROWS)],
    capture_output=True,
    text=True,
    cwd=ROOT,
    timeout=300,
  )
  lines = [x for x in result.stdout.splitlines() if x.startswith("RESULT ")]
  assert lines, result.stderr[-3000:]
  return {int(k): v for k, v in json.loads(lines[-1][7:]).items()}


@pytest.mark.parametrize(
  "index", range(len(ROWS)), ids=[f"{r[0]}{' '.join(r[1])}" for r in ROWS]
)
def test_bad_flag_value_is_a_usage_error(parsed, index):
  experiment, args, text = ROWS[index]
  error = parsed[index]
  assert error is not None, f"{experiment} accepted {args}"
  assert text in error and args[0].split("=")[0][2:] in error, error


def test_bad_flag_stops_the_app_without_a_traceback(tmp_path):
  result = subprocess.run(
    [
      sys.executable,
      "-m",
      "experiments.train",
      "--planner=magic",
      f"--out={tmp_path}",
    ],
    capture_output=True,
    text=True,
    cwd=ROOT,
    timeout=300,
  )
  assert result.returncode == 1
  assert "Flags parsing error" in result.stderr
  assert "--planner" in result.stderr and "Traceback" not in result.stderr
  assert not os.listdir(tmp_path)
