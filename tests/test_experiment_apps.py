"""Every experiment is an absl app on `experiments.common`: progress, --quiet.

Static (ast) for every app in experiments/: its flags include
`common.define_flags()` (--quiet; directly or through another experiment's
`define_flags()`), its `main` starts with `common.start`,
and it reports progress through `common.log` / `common.Progress` (directly
or through another experiments module's function). One cheap
app also runs twice, with and without --quiet. Their results.json is strict
JSON (`common.write_results`).
"""

import ast
import json
import math
import os
import pathlib
import subprocess
import sys

import pytest

from experiments import common

ROOT = pathlib.Path(__file__).resolve().parents[1]
APPS = sorted(
  p for p in (ROOT / "experiments").glob("*.py") if "app.run(" in p.read_text()
)
# Apps still being moved onto experiments.common (strict xfail: the mark
# has to go once they conform).
PENDING = set()


def _calls(tree: ast.AST) -> set[str]:
  """Dotted names of every call in `tree` ('common.log', 'app.run', ...)."""
  out = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Call):
      parts, func = [], node.func
      while isinstance(func, ast.Attribute):
        parts.append(func.attr)
        func = func.value
      if isinstance(func, ast.Name):
        parts.append(func.id)
        out.add(".".join(reversed(parts)))
  return out


def _function(tree: ast.Module, name: str) -> ast.FunctionDef | None:
  return next(
    (n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name),
    None,
  )


def _defines_quiet(path: pathlib.Path, seen=()) -> bool:
  """Whether the module's (_)define_flags() calls common.define_flags(),
  directly or through another experiment's define_flags()."""
  tree = ast.parse(path.read_text())
  flags_fn = _function(tree, "define_flags") or _function(tree, "_define_flags")
  if flags_fn is None:
    return False
  for call in _calls(flags_fn):
    module, _, name = call.rpartition(".")
    if name != "define_flags" or not module:
      continue
    if module == "common":
      return True
    other = ROOT / "experiments" / f"{module}.py"
    if other.exists() and other not in seen:
      if _defines_quiet(other, (*seen, path)):
        return True
  return False


def _reports_progress(path: pathlib.Path, seen=()) -> bool:
  """Whether the module calls `common.log` / `common.Progress`, directly
  or through a function of another experiments module that does (the
  pinned benchmarks' `pinned.timed_pairs`)."""
  calls = _calls(ast.parse(path.read_text()))
  if calls & {"common.log", "common.Progress"}:
    return True
  for call in calls:
    module, _, _ = call.rpartition(".")
    other = ROOT / "experiments" / f"{module}.py"
    if module and "." not in module and other.exists() and other not in seen:
      if _reports_progress(other, (*seen, path)):
        return True
  return False


def test_the_apps_are_found():
  names = {p.stem for p in APPS}
  assert {"train", "plan", "reproduce", "compare_planners"} <= names
  assert PENDING <= names


@pytest.mark.parametrize(
  "path",
  [
    pytest.param(
      p,
      marks=pytest.mark.xfail(
        strict=True, reason="not yet on experiments.common"
      ),
    )
    if p.stem in PENDING
    else p
    for p in APPS
  ],
  ids=lambda p: p.stem,
)
def test_app_uses_the_shared_progress_and_quiet_flag(path):
  tree = ast.parse(path.read_text())
  assert _defines_quiet(path), "no define_flags() with --quiet"
  main = _function(tree, "main")
  assert main is not None, "no main(argv)"
  body = [
    s
    for s in main.body
    if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))
  ]
  first = _calls(body[0]) if body else set()
  assert "common.start" in first, "main must call common.start(argv) first"
  assert _reports_progress(path), "no progress lines"


def _graph(tmp_path, *flags):
  env = dict(os.environ)
  env.pop("JAX_PLATFORMS", None)  # as a user runs it: JAX probes devices
  return subprocess.run(
    [
      sys.executable,
      "-m",
      "experiments.graph",
      "--model=two_branch",
      "--config=tiny",
      f"--out={tmp_path}",
      *flags,
    ],
    capture_output=True,
    text=True,
    cwd=ROOT,
    env=env,
    timeout=300,
  )


def test_quiet_silences_progress_and_startup_noise_stays_out(tmp_path):
  loud = _graph(tmp_path / "loud")
  assert loud.returncode == 0, loud.stderr[-3000:]
  assert "capturing two_branch (tiny)" in loud.stderr
  quiet = _graph(tmp_path / "quiet", "--quiet")
  assert quiet.returncode == 0, quiet.stderr[-3000:]
  assert "capturing" not in quiet.stderr
  assert (tmp_path / "quiet" / "graph.json").exists()
  assert "OpGraph two_branch" in quiet.stdout  # results still print
  for run in (loud, quiet):
    assert "xla_bridge" not in run.stderr
    assert "Unable to initialize backend" not in run.stderr


def test_results_are_strict_json(tmp_path):
  # A diverged loss or an unbounded time was written as NaN / Infinity,
  # which Python reads back but JSON readers (jq, browsers) refuse.
  path = common.write_results(
    str(tmp_path),
    {"loss": [1.0, math.nan], "time": {"max": math.inf}, "n": 3},
  )
  text = open(path).read()
  assert "NaN" not in text and "Infinity" not in text
  found = json.loads(text, parse_constant=lambda c: pytest.fail(c))
  assert found["loss"] == [1.0, None] and found["time"] == {"max": None}
  assert found["n"] == 3 and "environment" in found
