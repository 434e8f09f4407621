"""Distributed inference of a trained DISCO checkpoint: accuracy, bytes, time.

  python -m experiments.disco_infer --checkpoint=/tmp/disco/disco_seed0 \
    --num_nodes=2 --out=/tmp/disco_infer

Loads a checkpoint written by `experiments.disco_train`, runs the held-out
images through `disco.distributed` (one CPU device per node, each holding
only its node's weights) and checks the logits against one device. Counts
the bytes that cross between nodes from the compiled program and from the
masks, for the checkpoint and for dense channel parallelism (all masks one,
same weights). Times one device, dense channel parallelism and DISCO on
CPU devices made single-threaded, so that two of them really run in
parallel on two cores (the XLA flags are set before JAX starts). Predicts
latency for 2 and 4 nodes over links of 100 Mb/s to 100 Gb/s with
`disco.metrics.LatencyModel`, its compute rate calibrated on the measured
single device; 4 nodes re-split the checkpoint's weights and re-select its
masks by magnitude at the same ratio (not fine-tuned). Writes
`results.json` and, with the `plots` extra, `latency.png`.
"""

import os
import sys

from experiments import common


def _single_threaded_devices() -> None:
  """One single-threaded CPU device per node (at least 2): before JAX starts."""
  common.use_cpu_devices(max(2, common.int_flag_from_argv("num_nodes", 2)))
  flags = os.environ["XLA_FLAGS"].split()
  extra = [
    "--xla_cpu_multi_thread_eigen=false",
    "intra_op_parallelism_threads=1",
  ]
  os.environ["XLA_FLAGS"] = " ".join(
    flags + [f for f in extra if f not in flags]
  )
  os.environ.setdefault("JAX_PLATFORMS", "cpu")


if __name__ == "__main__":
  _single_threaded_devices()

import dataclasses  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402
from flax import nnx  # noqa: E402

from disco import checkpoint, data, distributed, metrics, prune, train  # noqa: E402
from disco.errors import (  # noqa: E402
  DataError,
  DiscoError,
  DistributedError,
  require_int,
  require_number,
)
from disco.models import architecture_of  # noqa: E402
from experiments import disco_settings  # noqa: E402

BANDWIDTHS_BITS = tuple(float(b) for b in np.logspace(8, 11, 31))


@dataclasses.dataclass(frozen=True)
class Settings:
  """Everything one run depends on.

  Example:
    >>> Settings(checkpoint="/tmp/disco/disco_seed0").num_nodes
    2

  Args:
    checkpoint: a folder written by experiments.disco_train.
    num_nodes: nodes to run on; must be the checkpoint's.
    dataset: a classification dataset of `disco.data.TASKS`; None: the
      one the checkpoint records (digits where it records none).
    data_dir: the CIFAR-10 python batch folder.
    test_fraction: share of digits / mnist held out; None: the one the
      checkpoint records (the dataset's default where it records none).
      Another than it was trained with would score training images.
    batch_size: images per distributed call.
    repeats: timed calls per latency figure (the median is reported).
    message_latency: latency model: seconds per message.
  """

  checkpoint: str
  num_nodes: int = 2
  dataset: str | None = None
  data_dir: str = ""
  test_fraction: float | None = None
  batch_size: int = 64
  repeats: int = 30
  message_latency: float = 1e-4

  def __post_init__(self):
    """The flags' bounds, for callers of `run` too (repeats=0 gave NaN
    latencies; batch_size=0 a traceback)."""
    for name in ("num_nodes", "batch_size", "repeats"):
      require_int(name, getattr(self, name), 1, DiscoError)
    require_number("message_latency", self.message_latency, error=DiscoError)


def define_flags() -> None:
  """Flags of the program; defined only when run as a program."""
  defaults = Settings(checkpoint="")
  flags.DEFINE_string("checkpoint", None, "Checkpoint folder.", required=True)
  flags.DEFINE_integer("num_nodes", defaults.num_nodes, "Nodes.", lower_bound=1)
  flags.DEFINE_enum(
    "dataset",
    None,
    list(data.TASKS["classify"]),
    "Dataset the checkpoint was trained on (default: the one it records).",
  )
  flags.DEFINE_string("data_dir", defaults.data_dir, "CIFAR-10 folder.")
  flags.DEFINE_float(
    "test_fraction",
    None,
    "Held-out share (default: the one the checkpoint records).",
  )
  flags.DEFINE_integer(
    "batch_size", defaults.batch_size, "Images per call.", lower_bound=1
  )
  flags.DEFINE_integer(
    "repeats", defaults.repeats, "Timed calls.", lower_bound=1
  )
  flags.DEFINE_float(
    "message_latency",
    defaults.message_latency,
    "Seconds per message.",
    lower_bound=0,
  )
  common.define_out()
  common.define_flags()


# Architectures whose held-out accuracy this experiment reports.
CLASSIFIERS = ("resnet", "vit")


def run(settings: Settings, out: str) -> dict:
  """The whole experiment; returns what it writes to `out`/results.json.

  Example:
    >>> settings = Settings(checkpoint="/tmp/disco/disco_seed0")
    >>> results = run(settings, "/tmp/disco_infer")  # doctest: +SKIP

  Args:
    settings: the run's settings.
    out: output folder (created).

  Raises:
    DiscoError: a checkpoint that is missing, malformed, not a
      classifier's, or for another number of nodes or image shape; too
      few devices.
  """
  started = time.perf_counter()
  model = checkpoint.load(settings.checkpoint)
  architecture = architecture_of(model)
  if architecture not in CLASSIFIERS:
    raise DataError(
      f"{settings.checkpoint} holds a {architecture}; disco_infer measures "
      f"image classifiers ({', '.join(CLASSIFIERS)}); experiments."
      "disco_train measures the other tasks' quality"
    )
  config = model.config
  if config.num_nodes != settings.num_nodes:
    raise DistributedError(
      f"{settings.checkpoint} holds a model split over {config.num_nodes} "
      f"nodes, not --num_nodes={settings.num_nodes}: pass "
      f"--num_nodes={config.num_nodes}"
    )
  name, options = disco_settings.held_out_split(
    settings.checkpoint, settings.dataset, settings.test_fraction
  )
  dataset = data.load(
    "classify",
    name,
    image_size=config.image_size,
    data_dir=settings.data_dir,
    **options,
  )
  shape = (config.image_size, config.image_size, config.in_channels)
  if dataset.image_shape != shape:
    raise DataError(
      f"{settings.checkpoint} takes images of shape {shape}, the "
      f"{dataset.name} images are {dataset.image_shape}: pass the dataset "
      "and image size it was trained with"
    )
  common.log(
    f"{type(model).__name__} over {config.num_nodes} nodes, comm ratio "
    f"{prune.comm_ratio(model):.3f}; {len(dataset.x_test)} held-out images"
  )
  os.makedirs(out, exist_ok=True)
  results = {
    # The split scored (the flags' None resolved from the checkpoint).
    "config": {**dataclasses.asdict(settings), "dataset": name, **options},
    "definitions": _DEFINITIONS,
  }
  batch = settings.batch_size
  single = _OneDevice(model)
  single_logits = _in_batches(single, dataset.x_test, batch)
  results["accuracy_single_device"] = train.accuracy(
    model, dataset.x_test, dataset.y_test
  )
  common.log(f"one device: accuracy {results['accuracy_single_device']:.4f}")
  common.log(
    "compiling distributed inference (DISCO and dense channel parallelism)"
  )
  mesh = distributed.node_mesh(config.num_nodes)
  disco = distributed.distribute(model, mesh)
  dense = distributed.distribute(metrics.with_masks(model, True), mesh)
  logits = _in_batches(disco, dataset.x_test, batch)
  results["accuracy"] = float(np.mean(logits.argmax(-1) == dataset.y_test))
  results["max_abs_error_vs_single_device"] = float(
    np.abs(logits - single_logits).max()
  )
  common.log(
    f"distributed: accuracy {results['accuracy']:.4f}, max |logits - one "
    f"device| {results['max_abs_error_vs_single_device']:.2e}"
  )
  results.update(_bytes(model, disco, dense, batch))
  common.log(
    f"bytes per inference: measured {results['bytes_per_inference_measured']}"
    f", from masks {results['bytes_per_inference_from_masks']}, dense "
    f"{results['bytes_per_inference_dense']} ("
    + (
      "DISCO sends nothing"
      if results["dense_over_disco_bytes"] is None
      else f"{results['dense_over_disco_bytes']:.1f}x"
    )
    + ")"
  )
  results["latency_ms"] = _measure(
    single, dense, disco, shape, batch, settings.repeats
  )
  results["latency_model"] = _predict(
    model, settings, results["latency_ms"]["one_device"]["per_batch"], batch
  )
  results["plot"] = _plot(results["latency_model"], batch, out)
  results["wall_seconds"] = round(time.perf_counter() - started, 1)
  common.log(f"wrote {common.write_results(out, results)}")
  return results


_DEFINITIONS = {
  "accuracy": "held-out accuracy of the distributed run",
  "accuracy_single_device": "the same checkpoint on one device",
  "bytes_per_inference_*": "bytes between nodes for one image; measured: "
  "read from the compiled program's collectives; from_masks: "
  "disco.metrics.count",
  "weight_bytes_per_device": "weights each device holds (padding included)",
  "latency_ms": "median wall time of one call, the runners taking turns: "
  "per_image at batch 1, per_batch at batch_size; cores_busy: process CPU "
  "seconds per wall second at batch_size (above 1: XLA ran the call on "
  "several threads although the flags ask for single-threaded devices)",
  "latency_model": "disco.metrics.LatencyModel over link bandwidths; "
  "crossover: the bandwidth above which the split model beats one device",
}


class _OneDevice:
  """The model on one device, with the calls `DistributedModel` has."""

  def __init__(self, model: nnx.Module):
    graphdef, state = nnx.split(model)
    self.device = jax.devices()[0]
    self.state = jax.device_put(state, self.device)
    self.forward = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))

  def place(self, images) -> jax.Array:
    return jax.device_put(np.asarray(images, np.float32), self.device)

  def apply(self, placed: jax.Array) -> jax.Array:
    return self.forward(self.state, placed)

  def __call__(self, images) -> np.ndarray:
    return np.asarray(self.apply(self.place(images)))


def _in_batches(runner, images: np.ndarray, batch: int) -> np.ndarray:
  """Logits of all `images`, `batch` at a time (the last one padded)."""
  outputs = []
  for start in range(0, len(images), batch):
    chunk = images[start : start + batch]
    padded = np.zeros((batch, *chunk.shape[1:]), np.float32)
    padded[: len(chunk)] = chunk
    outputs.append(runner(padded)[: len(chunk)])
  return np.concatenate(outputs)


def _bytes(model, disco, dense, batch: int) -> dict:
  disco_report = metrics.count(model)
  dense_report = metrics.count(metrics.with_masks(model, True))
  figures = {
    "bytes_per_inference_measured": disco.bytes_per_inference(batch),
    "bytes_per_inference_from_masks": disco_report.bytes_sent,
    "bytes_per_inference_dense": dense_report.bytes_sent,
    "bytes_per_inference_dense_measured": dense.bytes_per_inference(batch),
    "weight_bytes_per_device": {
      "disco": list(disco.device_weight_bytes().values()),
      "dense_parallel": list(dense.device_weight_bytes().values()),
      "one_device": distributed.ITEMSIZE * dense_report.total_params,
    },
    "weight_share_bytes_per_node": list(disco.share_bytes),
    "weight_padding_bytes_per_node": list(disco.padding_bytes),
    "flops_per_image": {
      "one_device": dense_report.flops,
      "disco_busiest_node": max(disco_report.flops_per_node),
    },
  }
  # None where DISCO sends nothing (one node, or no communication kept).
  figures["dense_over_disco_bytes"] = (
    dense_report.bytes_sent / disco_report.bytes_sent
    if disco_report.bytes_sent
    else None
  )
  return figures


def _measure(single, dense, disco, shape, batch: int, repeats: int) -> dict:
  """Median milliseconds per call, the three runners taking turns."""
  runners = {"one_device": single, "dense_parallel": dense, "disco": disco}
  figures = {name: {} for name in runners}
  for key, size in (("per_image", 1), ("per_batch", batch)):
    images = np.random.default_rng(0).random((size, *shape), np.float32)
    placed = {name: r.place(images) for name, r in runners.items()}
    times = {name: [] for name in runners}
    for _ in range(2):  # compile and warm up
      for name, runner in runners.items():
        runner.apply(placed[name]).block_until_ready()
    for _ in range(repeats):
      for name, runner in runners.items():
        begin = time.perf_counter()
        runner.apply(placed[name]).block_until_ready()
        times[name].append(time.perf_counter() - begin)
    for name in runners:
      figures[name][key] = 1e3 * float(np.median(times[name]))
      if size == batch:
        figures[name]["cores_busy"] = _cores_busy(runners[name], placed[name])
    common.log(
      f"latency {key} (batch {size}): "
      + ", ".join(f"{n} {figures[n][key]:.3f} ms" for n in runners)
    )
  return figures


def _cores_busy(runner, placed, calls: int = 10) -> float:
  """Process CPU seconds per wall second over `calls` calls."""
  cpu, wall = time.process_time(), time.perf_counter()
  for _ in range(calls):
    runner.apply(placed).block_until_ready()
  return (time.process_time() - cpu) / (time.perf_counter() - wall)


def _predict(model, settings: Settings, one_device_ms: float, batch: int):
  """LatencyModel curves for 2 and 4 nodes, calibrated on one device."""
  config = model.config
  shape = (config.image_size, config.image_size, config.in_channels)

  def costs(variant, size):
    return metrics.count(variant, input_shape=(size, *shape))

  dense = metrics.with_masks(model, True)
  flops_per_second = costs(dense, batch).flops / (one_device_ms / 1e3)
  links = [
    metrics.LatencyModel(flops_per_second, bits / 8, settings.message_latency)
    for bits in BANDWIDTHS_BITS
  ]
  ratio = prune.comm_ratio(model)
  splits, notes = {}, {}
  for nodes in (2, 4):
    try:
      splits[nodes] = (
        model if nodes == config.num_nodes else _resplit(model, nodes, ratio)
      )
    except DiscoError as error:
      notes[f"{nodes}_nodes"] = f"skipped: {error}"
  predicted, crossover = {}, {}
  for key, size in (("per_image", 1), ("per_batch", batch)):
    one_device = costs(dense, size).flops / flops_per_second
    predicted[key] = {"one_device": [1e3 * one_device] * len(links)}
    crossover[key] = {}
    for nodes, split in splits.items():
      for variant, masked in (
        ("dense", metrics.with_masks(split, True)),
        ("disco", split),
      ):
        report = costs(masked, size)
        name = f"{variant}_{nodes}_nodes"
        predicted[key][name] = [1e3 * link.latency(report) for link in links]
        crossover[key][name] = _crossover(
          report, flops_per_second, settings.message_latency, one_device
        )
  for name, bits in crossover["per_batch"].items():
    where = "never" if bits is None else f"above {bits / 1e6:.1f} Mb/s"
    common.log(f"latency model, batch {batch}: {name} beats one device {where}")
  return {
    "flops_per_second": flops_per_second,
    "message_latency_s": settings.message_latency,
    "comm_ratio": ratio,
    "bandwidths_bits_per_s": list(BANDWIDTHS_BITS),
    "predicted_ms": predicted,
    "crossover_bits_per_s": crossover,
    "notes": notes,
  }


def _resplit(model, nodes: int, ratio: float):
  """The model's weights over `nodes`, masks re-selected by magnitude."""
  config = dataclasses.replace(model.config, num_nodes=nodes)
  split = type(model)(config, rngs=nnx.Rngs(0))
  nnx.update(split, nnx.state(model, nnx.Any(nnx.Param, nnx.BatchStat)))
  prune.to_ratio(split, ratio, selection="magnitude")
  split.eval()
  return split


def _crossover(report, flops_per_second, message_latency, one_device):
  """Bits/s above which `report` beats `one_device` seconds; None: never."""

  def faster(bits):
    link = metrics.LatencyModel(flops_per_second, bits / 8, message_latency)
    return link.latency(report) < one_device

  low, high = 1.0, 1e18
  if not faster(high):
    return None
  if faster(low):
    return 0.0
  while high / low > 1.0001:  # latency falls as bandwidth grows
    middle = (low * high) ** 0.5
    low, high = (low, middle) if faster(middle) else (middle, high)
  return high


def _plot(latency_model: dict, batch: int, out: str):
  """latency.png: predicted latency against link bandwidth; None if no plot."""
  try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    common.log("plot skipped: matplotlib is missing (pip install '.[plots]')")
    return None
  bandwidths = latency_model["bandwidths_bits_per_s"]
  figure, axes = plt.subplots(1, 2, figsize=(11, 4.2))
  for axis, (key, title) in zip(
    axes,
    (("per_image", "one image"), ("per_batch", f"batch of {batch}")),
    strict=True,
  ):
    for name, values in latency_model["predicted_ms"][key].items():
      style = "k--" if name == "one_device" else "-"
      axis.loglog(bandwidths, values, style, label=name.replace("_", " "))
    axis.set_xlabel("link bandwidth (bit/s)")
    axis.set_ylabel("predicted latency (ms)")
    axis.set_title(f"{title}, r = {latency_model['comm_ratio']:.2f}")
    axis.grid(True, which="both", alpha=0.3)
  axes[0].legend(fontsize=8)
  figure.tight_layout()
  path = os.path.join(out, "latency.png")
  figure.savefig(path, dpi=120)
  plt.close(figure)
  common.log(f"wrote {path}")
  return path


_HEADLINE = (
  "accuracy",
  "accuracy_single_device",
  "max_abs_error_vs_single_device",
  "bytes_per_inference_measured",
  "bytes_per_inference_from_masks",
  "bytes_per_inference_dense",
  "latency_ms",
)


def main(argv):
  common.start(argv)
  values = {
    f.name: flags.FLAGS[f.name].value for f in dataclasses.fields(Settings)
  }
  try:
    results = run(Settings(**values), flags.FLAGS.out)
  except DiscoError as error:
    sys.exit(f"disco_infer: error: {error}")
  for key in _HEADLINE:
    print(f"{key}: {results[key]}")


if __name__ == "__main__":
  define_flags()
  app.run(main)
