"""Local multi-process runs: N processes on this machine, loopback only.

`launch` starts N copies of a Python command, each told (through
environment variables) its process id, the process count, the coordinator
address and how many CPU devices to simulate; `initialize_from_env` in the
child then calls `jax.distributed.initialize`. The same Trainer code runs
unchanged across processes: its mesh spans every process's devices.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Sequence

from graphpipe.errors import LaunchError

ENV_COORDINATOR = "GRAPHPIPE_COORDINATOR"
ENV_NUM_PROCESSES = "GRAPHPIPE_NUM_PROCESSES"
ENV_PROCESS_ID = "GRAPHPIPE_PROCESS_ID"


def free_port() -> int:
  """A TCP port on 127.0.0.1 that nothing listens on right now."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def launch(
  argv: Sequence[str],
  num_processes: int,
  devices_per_process: int,
  *,
  timeout: float = 600.0,
  env: dict | None = None,
) -> list[str]:
  """Runs `python argv...` in `num_processes` local processes.

  Example:
    Each process joins the run and reports its id and the global device
    count (a real run launches e.g. `["-m", "experiments.train"]`):

    >>> code = ("from graphpipe.runtime.launch import initialize_from_env; "
    ...         "import jax; initialize_from_env(); "
    ...         "print(jax.process_index(), jax.device_count())")
    >>> outputs = launch(["-c", code], num_processes=2, devices_per_process=2)
    >>> [out.splitlines()[-1] for out in outputs]
    ['0 4', '1 4']

  Args:
    argv: arguments after `python` (e.g. ['-m', 'module', '--flag']).
    num_processes: how many processes.
    devices_per_process: simulated CPU devices in each.
    timeout: seconds before every process is killed.
    env: extra environment variables.

  Returns:
    Each process's standard output, by process id.
  """
  port = free_port()
  procs = []
  for pid in range(num_processes):
    child = dict(os.environ)
    child.update(env or {})
    flags = child.get("XLA_FLAGS", "")
    flags = " ".join(
      f
      for f in flags.split()
      if not f.startswith("--xla_force_host_platform_device_count")
    )
    child["XLA_FLAGS"] = (
      f"{flags} --xla_force_host_platform_device_count={devices_per_process}"
    ).strip()
    child.setdefault("JAX_PLATFORMS", "cpu")
    child[ENV_COORDINATOR] = f"127.0.0.1:{port}"
    child[ENV_NUM_PROCESSES] = str(num_processes)
    child[ENV_PROCESS_ID] = str(pid)
    procs.append(
      subprocess.Popen(
        [sys.executable, *argv],
        env=child,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
      )
    )
  outputs = []
  try:
    for pid, proc in enumerate(procs):
      out, _ = proc.communicate(timeout=timeout)
      outputs.append(out)
      if proc.returncode != 0:
        raise LaunchError(
          f"process {pid} of {num_processes} exited with {proc.returncode}:"
          f"\n{out[-3000:]}"
        )
  except subprocess.TimeoutExpired as err:
    raise LaunchError(f"processes did not finish in {timeout} s") from err
  finally:
    for proc in procs:
      if proc.poll() is None:
        proc.kill()
  return outputs


def initialize_from_env() -> bool:
  """Joins the run `launch` started; False when not launched by it."""
  if ENV_COORDINATOR not in os.environ:
    return False
  import jax

  jax.distributed.initialize(
    coordinator_address=os.environ[ENV_COORDINATOR],
    num_processes=int(os.environ[ENV_NUM_PROCESSES]),
    process_id=int(os.environ[ENV_PROCESS_ID]),
  )
  return True
