"""Processes that die: mid-step, mid-save; what survives and what resumes.

The deaths are real: the runtime's own hook (`GRAPHPIPE_FAULT`,
`graphpipe.runtime.faults`) makes a process SIGKILL itself at a given
step, inside `Trainer.step` or inside `Trainer.save`. The time-outs of
the distributed runtime are set small so that nothing can hang for long.
"""

import gc
import os
import re
import time
import warnings

import numpy as np
import pytest

from graphpipe.errors import GraphpipeError, LaunchError
from graphpipe.runtime import checkpoints, faults
from graphpipe.runtime.launch import launch
from tests.graphpipe import fault_worker

WORKER = os.path.join(os.path.dirname(__file__), "fault_worker.py")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
QUICK = {"heartbeat_timeout": 3, "shutdown_timeout": 3, "init_timeout": 60}


def run_with_fault(fault, *args):
  env = {
    "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
    faults.ENV_FAULT: fault,
  }
  start = time.monotonic()
  with pytest.raises(LaunchError) as info:
    launch([WORKER, *args], 2, 1, env=env, timeout=120, **QUICK)
  return info.value, time.monotonic() - start


def losses_printed(text):
  return [float(v) for v in re.findall(r"^LOSS \d+ (\S+)$", text, re.M)]


@pytest.fixture(scope="module")
def uninterrupted():
  return fault_worker.train(4)


def test_process_killed_mid_step(uninterrupted):
  err, _ = run_with_fault("step:1:2", "4")
  message = str(err)
  # The launcher names the process that died and how.
  assert err.process_id == 1 and err.returncode == -9
  assert message.startswith("process 1 of 2 failed first: it was killed by ")
  assert "SIGKILL" in message.splitlines()[0]
  # The survivor stopped at once with an error that says why, instead of
  # hanging in the step's collectives (or aborting at exit).
  later = re.search(
    r"process 0 then exited with status 1 \((\S+) s later", message
  )
  assert later and float(later.group(1)) < 5, message.splitlines()[0]
  survivor = err.outputs[0]
  assert "error: ProcessLostError: process 0 of 2: the training step's " in (
    survivor
  )
  # Both got through steps 0 and 1, exactly as one process does.
  for process in (0, 1):
    assert losses_printed(err.outputs[process]) == uninterrupted[:2]


def test_process_killed_mid_save_resumes_from_last_good_checkpoint(
  tmp_path, uninterrupted
):
  root = str(tmp_path)
  err, _ = run_with_fault("save:1:2", "4", root)
  assert err.process_id == 1 and err.returncode == -9
  survivor = err.outputs[0]
  assert "ProcessLostError: process 0 of 2: the save to " in survivor
  assert losses_printed(survivor) == uninterrupted[:2]
  # The interrupted save is never taken for a checkpoint ...
  assert sorted(os.listdir(root)) == ["step_1", "step_2"]
  assert checkpoints.latest(root) == os.path.join(root, "step_1")
  trainer, model = fault_worker.trainer()
  with pytest.raises(GraphpipeError, match="its save did not finish"):
    trainer.restore(os.path.join(root, "step_2"))
  # ... the one before it is intact, and resuming from it (a fresh trainer
  # in another process) continues exactly as the uninterrupted run.
  state = trainer.restore(checkpoints.latest(root))
  assert int(np.asarray(state.step)) == 1
  resumed = []
  for s in range(1, 4):
    state, metrics = trainer.step(state, fault_worker.batch(s))
    resumed.append(metrics["loss"])
  assert resumed == uninterrupted[1:]


def test_save_over_a_checkpoint_uncommits_it_first(tmp_path):
  trainer, model = fault_worker.trainer()
  state = trainer.init(model)
  folder = str(tmp_path / "ckpt")
  trainer.save(state, folder)
  assert checkpoints.read_mark(folder)["step"] == 0
  state, _ = trainer.step(state, fault_worker.batch(0))
  trainer.save(state, folder)  # overwrites in place
  assert checkpoints.read_mark(folder)["step"] == 1
  assert int(np.asarray(trainer.restore(folder).step)) == 1
  # A bad fault specification is refused, not ignored.
  os.environ[faults.ENV_FAULT] = "step:x"
  try:
    with pytest.raises(GraphpipeError, match="WHERE:PROCESS:STEP"):
      trainer.step(state, fault_worker.batch(1))
  finally:
    del os.environ[faults.ENV_FAULT]


def test_launch_leaves_no_pipe_open(tmp_path):
  # Each child's output pipe is closed once read, whether the run passes or
  # a process fails (a pipe left to the garbage collector warns, and a
  # long-lived launcher would run out of file descriptors).
  code = "import sys; print('done'); sys.exit(int(sys.argv[1]))"
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always", ResourceWarning)
    assert launch(["-c", code, "0"], 2, 1) == ["done\n", "done\n"]
    with pytest.raises(LaunchError, match="exited with status 3"):
      launch(["-c", code, "3"], 2, 1, **QUICK)
    gc.collect()
  leaks = [w for w in caught if issubclass(w.category, ResourceWarning)]
  assert not leaks, [str(w.message) for w in leaks]


def test_a_run_past_its_timeout_is_an_error():
  # launch returned the partial outputs as a success (the killed processes
  # counted as finished), so `experiments.train --num_processes=2` exited 0
  # after 10 minutes with no results.
  code = "import sys, time; print('started', flush=True); time.sleep(60)"
  start = time.monotonic()
  with pytest.raises(LaunchError, match=r"processes \[0, 1\] did not finish"):
    launch(["-c", code], 2, 1, timeout=3, **QUICK)
  assert time.monotonic() - start < 30


def test_latest_of_a_file_is_none(tmp_path):
  # NotADirectoryError before; the docstring promises None.
  path = tmp_path / "afile"
  path.write_text("x")
  assert checkpoints.latest(str(path)) is None
  assert checkpoints.latest(str(path / "sub")) is None


def test_joining_twice_is_a_no_op():
  # A module that joined on import, then the script: JAX's initialize
  # raised "should only be called once".
  code = (
    "from graphpipe.runtime.launch import initialize_from_env as join; "
    "import jax; print(join(), join(), jax.process_count())"
  )
  env = {"PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
  outputs = launch(["-c", code], 2, 1, env=env, timeout=120, **QUICK)
  assert [out.splitlines()[-1] for out in outputs] == ["True True 2"] * 2
