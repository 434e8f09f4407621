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
os.environ.setdefault("JAX_PLATFORMS", "cpu")
