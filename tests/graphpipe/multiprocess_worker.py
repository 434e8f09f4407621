"""Child of test_two_processes_reproduce_one_process: 3 steps, prints losses."""

import json

from graphpipe.runtime.launch import initialize_from_env

initialize_from_env()

import jax  # noqa: E402
import optax  # noqa: E402

from graphpipe.runtime import Trainer  # noqa: E402
from tests.graphpipe import runtime_cases as rc  # noqa: E402

plan = rc.pipeline_plan("two_branch", 8, "graphpipe")
model, _ = rc.model_and_batch("two_branch")
trainer = Trainer(plan, optax.sgd(0.1), graph=rc.tiny_graph("two_branch"))
state = trainer.init(model)
losses = []
for s in range(3):
  state, metrics = trainer.step(state, rc.model_and_batch("two_branch", s)[1])
  losses.append(metrics["loss"])
result = {
  "process": jax.process_index(),
  "devices": jax.device_count(),
  "losses": losses,
}
print("RESULT " + json.dumps(result), flush=True)
