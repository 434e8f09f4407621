"""Local multi-process runs: N processes on this machine, loopback only.

`launch` starts N copies of a Python command, each told (through
environment variables) its process id, the process count, the coordinator
address and how many CPU devices to simulate; `initialize_from_env` in the
child then calls `jax.distributed.initialize`. The same Trainer code runs
unchanged across processes: its mesh spans every process's devices.
"""

from __future__ import annotations

import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

from graphpipe.errors import LaunchError

ENV_COORDINATOR = "GRAPHPIPE_COORDINATOR"
ENV_NUM_PROCESSES = "GRAPHPIPE_NUM_PROCESSES"
ENV_PROCESS_ID = "GRAPHPIPE_PROCESS_ID"
# "init,heartbeat,shutdown" seconds for jax.distributed.initialize.
ENV_TIMEOUTS = "GRAPHPIPE_DISTRIBUTED_TIMEOUTS"


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
  heartbeat_timeout: int = 100,
  shutdown_timeout: int = 300,
  init_timeout: int = 300,
) -> list[str]:
  """Runs `python argv...` in `num_processes` local processes.

  When a process fails, the others get a bounded time to notice (their
  collectives fail at once when a peer's connection closes; otherwise JAX's
  heartbeat check stops them after `heartbeat_timeout` seconds) before they
  are killed, and the `LaunchError` names the process that failed first
  and how (exit status or signal), with the last lines of every output.

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
    heartbeat_timeout: seconds without a heartbeat after which JAX takes a
      process for dead and stops the others (`initialize_from_env`).
    shutdown_timeout: seconds a finishing process waits for the others
      (then it aborts: keep it above the longest gap between processes
      finishing normally).
    init_timeout: seconds a process waits for the others to join.

  Returns:
    Each process's standard output, by process id.

  Raises:
    LaunchError: a process exited with a non-zero status or was killed
      (`process_id`, `returncode` say which and how), or the run took
      longer than `timeout`.
  """
  if num_processes < 1 or devices_per_process < 1:
    raise LaunchError(
      f"need at least one process and one device each, got {num_processes} "
      f"processes of {devices_per_process} devices"
    )
  port = free_port()
  timeouts = f"{init_timeout},{heartbeat_timeout},{shutdown_timeout}"
  procs = [
    subprocess.Popen(
      [sys.executable, *argv],
      env=_child_env(
        env, devices_per_process, port, num_processes, pid, timeouts
      ),
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
    )
    for pid in range(num_processes)
  ]
  begin = time.monotonic()
  finished = queue.Queue()
  outputs = [""] * num_processes
  ended = [None] * num_processes

  def drain(pid, proc):
    with proc.stdout:  # the pipe is closed once read, not left to GC
      outputs[pid] = proc.stdout.read()
    proc.wait()
    ended[pid] = time.monotonic() - begin
    finished.put(pid)

  threads = [
    threading.Thread(target=drain, args=(pid, proc), daemon=True)
    for pid, proc in enumerate(procs)
  ]
  for thread in threads:
    thread.start()
  failed, deadline = None, begin + timeout
  try:
    for _ in range(num_processes):
      try:
        pid = finished.get(timeout=max(0.0, deadline - time.monotonic()))
      except queue.Empty:
        break
      if procs[pid].returncode != 0 and failed is None:
        failed = pid
        # The others get a bounded time to notice, then are stopped.
        grace = heartbeat_timeout + shutdown_timeout + 10
        deadline = min(deadline, time.monotonic() + grace)
  finally:
    # Still running here = past the deadline (or launch itself was
    # interrupted): the drain threads record them as ended once killed.
    unfinished = [pid for pid, proc in enumerate(procs) if proc.poll() is None]
    for pid in unfinished:
      procs[pid].kill()
    for thread in threads:
      thread.join(timeout=10)
  if failed is not None:
    raise LaunchError(
      _failure_report(procs, outputs, ended, failed),
      process_id=failed,
      returncode=procs[failed].returncode,
      outputs=outputs,
    )
  if unfinished or any(t is None for t in ended):
    raise LaunchError(
      f"processes {unfinished} did not finish in {timeout} s (killed):\n"
      + _tails(procs, outputs, range(num_processes)),
      outputs=outputs,
    )
  return outputs


def _child_env(env, devices, port, num_processes, pid, timeouts) -> dict:
  child = dict(os.environ)
  child.update(env or {})
  flags = " ".join(
    f
    for f in child.get("XLA_FLAGS", "").split()
    if not f.startswith("--xla_force_host_platform_device_count")
  )
  child["XLA_FLAGS"] = (
    f"{flags} --xla_force_host_platform_device_count={devices}"
  ).strip()
  child.setdefault("JAX_PLATFORMS", "cpu")
  child[ENV_COORDINATOR] = f"127.0.0.1:{port}"
  child[ENV_NUM_PROCESSES] = str(num_processes)
  child[ENV_PROCESS_ID] = str(pid)
  child[ENV_TIMEOUTS] = (env or {}).get(ENV_TIMEOUTS, timeouts)
  return child


def _how(returncode: int | None) -> str:
  if returncode is None:
    return "was still running and was killed"
  if returncode < 0:
    try:
      name = signal.Signals(-returncode).name
    except ValueError:
      name = f"signal {-returncode}"
    return f"was killed by {name} (exit status {returncode})"
  return f"exited with status {returncode}"


def _failure_report(procs, outputs, ended, failed) -> str:
  n = len(procs)
  lines = [
    f"process {failed} of {n} failed first: it {_how(procs[failed].returncode)}"
    f" after {ended[failed]:.1f} s"
  ]
  for pid in range(n):
    if pid == failed:
      continue
    # A process the launcher had to kill has no end time of its own.
    if ended[pid] is None or procs[pid].returncode == -signal.SIGKILL:
      lines.append(f"process {pid} {_how(procs[pid].returncode)}")
    else:
      later = ended[pid] - ended[failed]
      lines.append(
        f"process {pid} then {_how(procs[pid].returncode)} "
        f"({later:.1f} s later)"
      )
  order = [failed] + [p for p in range(n) if p != failed]
  return "; ".join(lines) + "\n" + _tails(procs, outputs, order)


def _tails(procs, outputs, order) -> str:
  return "\n".join(
    f"--- process {pid} (last lines) ---\n{(outputs[pid] or '')[-2000:]}"
    for pid in order
  )


def leave(message: str, code: int = 1) -> None:
  """Ends this process now with `message` on stderr and status `code`.

  For a launched process whose run failed: a normal exit would first wait
  (up to the shutdown time-out) for a distributed shutdown that a dead
  process can no longer join, and then abort.
  """
  print(message, file=sys.stderr, flush=True)
  sys.stdout.flush()
  os._exit(code)


def initialize_from_env() -> bool:
  """Joins the run `launch` started; False when not launched by it. A
  second call (e.g. from a module that called it on import) is a no-op
  (JAX's own initialize raises on a second call)."""
  if ENV_COORDINATOR not in os.environ:
    return False
  import jax

  if jax.distributed.is_initialized():
    return True

  init, heartbeat, shutdown = (
    int(x) for x in os.environ.get(ENV_TIMEOUTS, "300,100,300").split(",")
  )
  jax.distributed.initialize(
    coordinator_address=os.environ[ENV_COORDINATOR],
    num_processes=int(os.environ[ENV_NUM_PROCESSES]),
    process_id=int(os.environ[ENV_PROCESS_ID]),
    initialization_timeout=init,
    heartbeat_timeout_seconds=heartbeat,
    shutdown_timeout_seconds=shutdown,
  )
  return True
