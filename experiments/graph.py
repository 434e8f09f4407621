"""Capture a zoo model into an operator graph and write it out.

  python -m experiments.graph --model=mmt --config=paper --out=/tmp/mmt

writes DIR/graph.json and DIR/graph.dot and prints the node table and the
totals. Paper configs are captured on abstract weights (nothing of paper size
is allocated), so every model takes seconds.
"""

import json
import os
import resource
import time

from absl import app, flags

from experiments import common
from graphpipe import models

FLAGS = flags.FLAGS


def define_flags() -> None:
  """This experiment's flags (defined when run, so tests import freely)."""
  common.define_flags()
  flags.DEFINE_enum("model", "two_branch", models.NAMES, "Zoo model.")
  flags.DEFINE_enum("config", "tiny", models.SIZES, "Model size.")
  flags.DEFINE_integer(
    "batch_size",
    8,
    "Batch size to trace at (figures are per sample).",
    lower_bound=1,
  )
  flags.DEFINE_string(
    "granularity",
    None,
    "'layer', 'block' or a module depth >= 1; default: the model's capture "
    "depth.",
  )
  flags.register_validator(
    "granularity",
    lambda text: (
      text is None
      or text in ("layer", "block")
      or (text.isdigit() and int(text) >= 1)
    ),
    message="--granularity takes layer, block or a module depth >= 1",
  )
  common.define_out()


def _granularity(text):
  if text is None:
    return None
  return int(text) if text.isdigit() else text


def main(argv):
  common.start(argv)
  start = time.perf_counter()
  common.log(f"capturing {FLAGS.model} ({FLAGS.config})")
  graph = models.capture_zoo(
    FLAGS.model,
    FLAGS.config,
    FLAGS.batch_size,
    _granularity(FLAGS.granularity),
  )
  seconds = time.perf_counter() - start
  os.makedirs(FLAGS.out, exist_ok=True)
  graph.save(os.path.join(FLAGS.out, "graph.json"))
  with open(os.path.join(FLAGS.out, "graph.dot"), "w") as f:
    f.write(graph.to_dot())
  print(graph)
  totals = graph.totals()
  peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
  print(
    json.dumps(
      {
        "model": FLAGS.model,
        "config": FLAGS.config,
        "nodes": totals["num_nodes"],
        "edges": totals["num_edges"],
        "sources": len(graph.sources()),
        "parameters": graph.meta["num_params"],
        "fwd_gflop_per_sample": totals["fwd_flops"] / 1e9,
        "bwd_gflop_per_sample": totals["bwd_flops"] / 1e9,
        "param_gb": totals["param_bytes"] / 1e9,
        "activation_mb_per_sample": totals["activation_bytes"] / 1e6,
        "saved_mb_per_sample": totals["saved_bytes"] / 1e6,
        "capture_s": round(seconds, 2),
        "peak_rss_gb": round(peak_rss / 2**30, 2),
      },
      indent=1,
    )
  )
  print(f"wrote {FLAGS.out}/graph.json and graph.dot")


if __name__ == "__main__":
  define_flags()
  app.run(main)
