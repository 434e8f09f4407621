"""Root pytest configuration: 8 simulated CPU devices for every test.

The flag must be set before JAX is imported anywhere, which is why it lives
in the root conftest (pytest imports it before collecting the tests).
"""

import os
import pathlib

import pytest

_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " " + _FLAG
  ).strip()
# bf16 exactness (tests/graphpipe/test_numerics.py) holds when XLA rounds
# every bf16 operation: by default it may skip roundings inside a fusion,
# differently in a whole program and in a pipeline stage
# (docs/guide/training.md, "Exactness").
_STRICT = "--xla_allow_excess_precision=false"
if _STRICT not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " " + _STRICT
# Tests prove correctness, not speed: XLA's LLVM back end optimises less
# (what jax's `jax_disable_most_optimizations` sets), which cuts the
# suite's compile time by about a quarter. The HLO passes (fusion, buffer
# assignment: what the memory and byte-count tests read) are unchanged: the
# same optimised HLO and `memory_analysis` with and without (BUILD.md,
# "Tests"). GRAPHPIPE_TEST_FULL_OPT=1 compiles as users do.
if os.environ.get("GRAPHPIPE_TEST_FULL_OPT") != "1":
  for _flag in (
    "--xla_backend_optimization_level=0",
    "--xla_llvm_disable_expensive_passes=true",
  ):
    if _flag.split("=")[0] not in os.environ["XLA_FLAGS"]:
      os.environ["XLA_FLAGS"] += " " + _flag
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# Hypothesis runs are derandomised: every run of the suite draws the same
# examples, so a failure reproduces. GRAPHPIPE_HYPOTHESIS_PROFILE=explore
# draws fresh ones (e.g. with GRAPHPIPE_RANDOM_GRAPHS=20000 before a
# release).
from hypothesis import settings as _hypothesis_settings  # noqa: E402

_hypothesis_settings.register_profile("ci", derandomize=True)
_hypothesis_settings.register_profile("explore", derandomize=False)
_hypothesis_settings.load_profile(
  os.environ.get("GRAPHPIPE_HYPOTHESIS_PROFILE", "ci")
)

# The longest modules are collected first: xdist's loadscope hands whole
# modules to the two workers in collection order (pytest.ini turns off its
# own reordering by test count, which queued the three-test notebook module,
# ~2 min, last, to run alone at the end). Measured with `--durations=0`
# (BUILD.md, "Tests"); the rest keep their order.
_LONG_FIRST = (
  "tests/graphpipe/test_runtime.py",
  "tests/test_notebooks.py",
  "tests/graphpipe/test_experiment_train.py",
  "tests/graphpipe/test_random_graphs.py",
  "tests/graphpipe/test_bench_overhead.py",
  "tests/graphpipe/test_runtime_micro_batches.py",
  "tests/graphpipe/test_runtime_extra.py",
)


# The quick tier (`pytest -m "not slow"`) leaves out what tests/slow.txt
# lists: each test measured at 3 s or more in a timed full run, a module
# where all of its tests are (`python -m tests.tiers`, BUILD.md "Tests").
# A test may also carry `@pytest.mark.slow` itself.
_SLOW = pathlib.Path(__file__).parent / "tests" / "slow.txt"


def _slow_entries() -> set[str]:
  lines = _SLOW.read_text().splitlines() if _SLOW.exists() else []
  return {line.strip() for line in lines if line.strip()[:1] not in ("", "#")}


def pytest_collection_modifyitems(items):
  slow = _slow_entries()
  for item in items:
    if item.nodeid in slow or item.nodeid.split("::")[0] in slow:
      item.add_marker(pytest.mark.slow)
  rank = {path: i for i, path in enumerate(_LONG_FIRST)}
  items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))
