"""Train dense, prune to a communication ratio, fine-tune; compare baselines.

  python -m experiments.disco_train --model=resnet --dataset=digits \
    --num_nodes=2 --comm_ratio=0.2 --selection=magnitude --out=/tmp/disco

For every seed: train the dense model (all masks one); from it, train three
models for the same number of epochs, pruning gradually and then with the
masks fixed: DISCO (--selection at --comm_ratio), random selection at the
same ratio, and no communication (ratio 0). All are evaluated on the
held-out split. Writes `results.json` (accuracies: mean over seeds beside
the per-seed values; costs of one inference of one image for the first
seed's DISCO model, against dense channel parallelism and a single device)
and one checkpoint per seed (`disco_seed<N>/`, read by
`disco.checkpoint.load`).
"""

import dataclasses
import json
import os
import platform
import sys
import time

import jax
import numpy as np
from absl import app, flags
from flax import nnx

from disco import checkpoint, data, metrics, prune, train
from disco.errors import DataError, DiscoError
from disco.models import ResNet, ResNetConfig, ViT, ViTConfig


@dataclasses.dataclass(frozen=True)
class Settings:
  """Everything one run depends on; the defaults are the reported run.

  Example:
    >>> Settings(seeds=1).width
    8

  Args:
    model: "resnet" or "vit".
    dataset: "digits", "cifar10" or "synthetic".
    data_dir: the CIFAR-10 python batch folder.
    image_size: side of the digits / synthetic images.
    test_fraction: share of the digits held out (stratified).
    width: ResNet stage widths width, 2 width, 4 width; ViT embedding 4 width.
    num_nodes: nodes every layer is split over.
    comm_ratio: kept cross-node channel groups of the DISCO model.
    selection: channel selection of the DISCO model.
    budget: "layer" or "global" pruning budget.
    seeds: number of seeds.
    first_seed: seeds first_seed .. first_seed + seeds - 1.
    dense_epochs: epochs of dense training.
    prune_epochs: epochs of gradual pruning (from the dense model).
    finetune_epochs: epochs with the masks fixed, after pruning.
    prune_every: training steps between pruning updates.
    batch_size: images per step.
    learning_rate: peak learning rate of dense training.
    finetune_learning_rate: peak learning rate of pruning + fine-tuning.
    weight_decay: AdamW weight decay.
    group_lasso: weight of the group-lasso term while pruning.
    flops_per_second: latency model: compute rate of a node.
    link_bytes_per_second: latency model: link bandwidth.
    message_latency: latency model: seconds per message.
  """

  model: str = "resnet"
  dataset: str = "digits"
  data_dir: str = ""
  image_size: int = 16
  test_fraction: float = 0.4
  width: int = 8
  num_nodes: int = 2
  comm_ratio: float = 0.2
  selection: str = "magnitude"
  budget: str = "layer"
  seeds: int = 3
  first_seed: int = 0
  dense_epochs: int = 30
  prune_epochs: int = 15
  finetune_epochs: int = 15
  prune_every: int = 5
  batch_size: int = 64
  learning_rate: float = 3e-3
  finetune_learning_rate: float = 1e-3
  weight_decay: float = 1e-4
  group_lasso: float = 1e-3
  flops_per_second: float = 1e11
  link_bytes_per_second: float = 12.5e6
  message_latency: float = 1e-4


def _define_flags() -> None:
  """One flag per setting, its help text from the `Settings` docstring.

  Called only when run as a program, so importing this module (tests call
  `run`) defines no global flags that could clash with other experiments.
  """
  choices = {
    "model": ["resnet", "vit"],
    "dataset": ["digits", "cifar10", "synthetic"],
    "selection": list(prune.SELECTIONS),
    "budget": list(prune.BUDGETS),
  }
  helps = dict(
    line.strip().split(": ", 1)
    for line in Settings.__doc__.split("Args:")[1].splitlines()
    if line.startswith("    ") and not line.startswith("      ")
  )
  defaults = Settings()
  for field in dataclasses.fields(Settings):
    name, default = field.name, getattr(defaults, field.name)
    if name in choices:
      flags.DEFINE_enum(name, default, choices[name], helps[name])
    elif isinstance(default, str):
      flags.DEFINE_string(name, default, helps[name])
    elif isinstance(default, int):
      flags.DEFINE_integer(name, default, helps[name])
    else:
      flags.DEFINE_float(name, default, helps[name])
  flags.DEFINE_string("out", None, "Output folder.", required=True)


_HEADLINE = (
  "accuracy_dense_per_seed",
  "accuracy_disco_per_seed",
  "accuracy_random_per_seed",
  "accuracy_no_comm_per_seed",
  "accuracy_dense",
  "accuracy_disco",
  "accuracy_random",
  "accuracy_no_comm",
  "ratios",
  "wall_seconds",
)


def main(argv):
  del argv
  settings = Settings(
    **{f.name: flags.FLAGS[f.name].value for f in dataclasses.fields(Settings)}
  )
  try:
    results = run(settings, flags.FLAGS.out)
  except DiscoError as error:
    sys.exit(f"disco_train: error: {error}")
  for key in _HEADLINE:
    log(f"{key}: {results[key]}")


def log(text: str) -> None:
  """Prints one progress line at once."""
  print(text, flush=True)


def run(settings: Settings, out: str) -> dict:
  """The whole experiment; returns what it writes to `out`/results.json.

  Example (a smoke run, seconds):
    >>> quick = Settings(dataset="synthetic", seeds=1, dense_epochs=1,
    ...                  prune_epochs=1, finetune_epochs=1)
    >>> results = run(quick, "/tmp/disco_smoke")  # doctest: +SKIP

  Args:
    settings: the run's settings.
    out: output folder (created).
  """
  started = time.perf_counter()
  prune.check_ratio(settings.comm_ratio)
  dataset = _dataset(settings)
  log(
    f"{dataset.name}: {len(dataset.x_train)} train / {len(dataset.x_test)} "
    f"held-out images of shape {dataset.image_shape}"
  )
  os.makedirs(out, exist_ok=True)
  variants = {
    "disco": (settings.comm_ratio, settings.selection),
    "random": (settings.comm_ratio, "random"),
    "no_comm": (0.0, "magnitude"),
  }
  accuracies = {name: [] for name in ("dense", *variants)}
  checkpoints = []
  first_disco = None
  for seed in range(settings.first_seed, settings.first_seed + settings.seeds):
    dense = _build(settings, dataset, seed)
    log(f"seed {seed}: dense training")
    _fit(settings, dense, dataset, seed, None)
    accuracies["dense"].append(_accuracy(dense, dataset, f"seed {seed} dense"))
    for name, (ratio, selection) in variants.items():
      log(f"seed {seed}: {name} (ratio {ratio}, {selection} selection)")
      model = nnx.clone(dense)
      schedule = _schedule(settings, dataset, ratio, selection, seed)
      _fit(settings, model, dataset, seed, schedule)
      accuracies[name].append(_accuracy(model, dataset, f"seed {seed} {name}"))
      if name == "disco":
        folder = os.path.join(out, f"disco_seed{seed}")
        checkpoint.save(model, folder)
        checkpoints.append(folder)
        if first_disco is None:
          first_disco = model
  results = _results(settings, accuracies, first_disco, checkpoints)
  results["wall_seconds"] = round(time.perf_counter() - started, 1)
  with open(os.path.join(out, "results.json"), "w") as file:
    json.dump(results, file, indent=1)
  log(f"wrote {os.path.join(out, 'results.json')}")
  return results


def _dataset(settings: Settings) -> data.Dataset:
  if settings.dataset == "digits":
    return data.digits(
      image_size=settings.image_size, test_fraction=settings.test_fraction
    )
  if settings.dataset == "cifar10":
    if not settings.data_dir:
      raise DataError("--dataset=cifar10 needs --data_dir")
    return data.cifar10(settings.data_dir)
  return data.synthetic(image_size=settings.image_size)


def _build(settings: Settings, dataset: data.Dataset, seed: int):
  size, _, channels = dataset.image_shape
  common = dict(
    num_nodes=settings.num_nodes,
    image_size=size,
    in_channels=channels,
    num_classes=dataset.num_classes,
  )
  width = settings.width
  if settings.model == "resnet":
    config = ResNetConfig(
      widths=(width, 2 * width, 4 * width), stem_width=width, **common
    )
    return ResNet(config, rngs=nnx.Rngs(seed))
  config = ViTConfig(dim=4 * width, mlp_dim=8 * width, **common)
  return ViT(config, rngs=nnx.Rngs(seed))


def _schedule(settings, dataset, ratio, selection, seed):
  config = train.TrainConfig(epochs=1, batch_size=settings.batch_size)
  steps = settings.prune_epochs * config.steps_per_epoch(len(dataset.x_train))
  return prune.GradualSchedule(
    target_ratio=ratio,
    steps=max(steps, 1),
    every=settings.prune_every,
    budget=settings.budget,
    selection=selection,
    seed=seed,
  )


def _fit(settings, model, dataset, seed, schedule):
  if schedule is None:
    epochs, learning_rate = settings.dense_epochs, settings.learning_rate
  else:
    epochs = settings.prune_epochs + settings.finetune_epochs
    learning_rate = settings.finetune_learning_rate
  config = train.TrainConfig(
    epochs=epochs,
    batch_size=settings.batch_size,
    learning_rate=learning_rate,
    weight_decay=settings.weight_decay,
    group_lasso=settings.group_lasso,
  )
  train.fit(
    model,
    dataset.x_train,
    dataset.y_train,
    config,
    seed=seed,
    schedule=schedule,
    progress=lambda line: log(f"  {line}"),
  )


def _accuracy(model, dataset, label) -> float:
  value = train.accuracy(model, dataset.x_test, dataset.y_test)
  log(
    f"{label}: held-out accuracy {value:.4f} (comm ratio "
    f"{prune.comm_ratio(model):.3f})"
  )
  return value


def _results(settings, accuracies, model, checkpoints) -> dict:
  disco_report = metrics.count(model)
  dense_report = metrics.count(metrics.with_masks(model, True))
  costs = {"disco": disco_report.summary(), "dense": dense_report.summary()}
  link = metrics.LatencyModel(
    settings.flops_per_second,
    settings.link_bytes_per_second,
    settings.message_latency,
  )
  single = metrics.single_device_summary(dense_report)
  results = {
    "config": dataclasses.asdict(settings),
    "environment": {
      "jax": jax.__version__,
      "backend": jax.default_backend(),
      "cpu_count": os.cpu_count(),
      "python": platform.python_version(),
    },
    "definitions": {
      "accuracy_*": "held-out accuracy, mean over seeds",
      "comm_bytes_*": "bytes between nodes for one image (fp32 values)",
      "flops_*": "FLOPs for one image, all nodes together",
      "params_per_node_dense": "the dense model: all of it on one node",
      "params_per_node_channel_parallel": "dense model split over nodes",
      "params_per_node_disco": "parameters of the busiest DISCO node",
    },
  }
  for name, values in accuracies.items():
    results[f"accuracy_{name}"] = float(np.mean(values))
    results[f"accuracy_{name}_per_seed"] = values
  results.update(
    comm_bytes_dense=costs["dense"]["bytes_sent"],
    comm_bytes_disco=costs["disco"]["bytes_sent"],
    flops_dense=single["flops"],
    flops_disco=costs["disco"]["flops"],
    flops_per_node_disco=costs["disco"]["flops_per_node"],
    params_per_node_dense=single["params_per_node"],
    params_per_node_channel_parallel=costs["dense"]["params_per_node"],
    params_per_node_disco=costs["disco"]["params_per_node"],
    memory_per_node_dense=single["memory_per_node"],
    memory_per_node_disco=costs["disco"]["memory_per_node"],
    comm_ratio_measured=prune.comm_ratio(model),
    latency_s_single_device=link.single_device_latency(dense_report),
    latency_s_dense=link.latency(dense_report),
    latency_s_disco=link.latency(disco_report),
    checkpoints=checkpoints,
    layers_disco=[_layer(layer) for layer in disco_report.layers],
  )
  results["ratios"] = {
    "comm_bytes": results["comm_bytes_disco"] / results["comm_bytes_dense"],
    "flops": results["flops_disco"] / results["flops_dense"],
    "params_per_node": results["params_per_node_disco"]
    / results["params_per_node_dense"],
  }
  return results


def _layer(layer: metrics.LayerCost) -> dict:
  return {
    "name": layer.name,
    "kind": layer.kind,
    "flops": sum(layer.flops),
    "bytes_sent": layer.bytes_sent,
    "params_per_node": max(layer.params),
  }


if __name__ == "__main__":
  _define_flags()
  app.run(main)
