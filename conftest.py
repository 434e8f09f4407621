"""Root pytest configuration: 8 simulated CPU devices for every test.

The flag must be set before JAX is imported anywhere, which is why it lives
in the root conftest (pytest imports it before collecting the tests).
"""

import os

_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " " + _FLAG
  ).strip()
# bf16 exactness (tests/graphpipe/test_numerics.py) holds when XLA rounds
# every bf16 operation: by default it may skip roundings inside a fusion,
# differently in a whole program and in a pipeline stage (BUILD.md).
_STRICT = "--xla_allow_excess_precision=false"
if _STRICT not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " " + _STRICT
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
