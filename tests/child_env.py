"""The environment of the tests' child processes (experiments, notebooks).

A child sets up its own devices, as a user's run would: the test run's
device count (8, from the root conftest) is taken out of `XLA_FLAGS`. The
conftest's other XLA flags stay: the child compiles as the tests do (the
LLVM back end optimising less: tests check results, never speed; the
bench_overhead smoke 47 -> 33 s).
"""

import os

DEVICE_COUNT = "--xla_force_host_platform_device_count"


def xla_flags_without_device_count() -> str:
  """This process's `XLA_FLAGS` less the device count ('' if nothing
  else is set)."""
  return " ".join(
    f
    for f in os.environ.get("XLA_FLAGS", "").split()
    if not f.startswith(DEVICE_COUNT)
  )


def child_env() -> dict[str, str]:
  """A copy of this process's environment for a child that sets its own
  device count."""
  env = dict(os.environ)
  flags = xla_flags_without_device_count()
  if flags:
    env["XLA_FLAGS"] = flags
  else:
    env.pop("XLA_FLAGS", None)
  return env
