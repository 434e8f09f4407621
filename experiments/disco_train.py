"""DISCO on a task: dense, DISCO, random selection and no communication.

  python -m experiments.disco_train --task=classify|superres|segment|detect \
    --dataset=digits|mnist|cifar10|synthetic|photos|shapes \
    [--sweep=0.05,0.1,0.2,0.3,0.5] --out=DIR

Data come from `disco.data.load`; a validation set (held-out photographs
for super-resolution, else a share of the training split) chooses the
learning rate of dense training (`--learning_rates`), the DISCO arm's
pruning budget where `--budget` lists several (`layer,global,bytes`, on
the first seed) and, with `--sweep`, the smallest ratio within `--tolerance` of
dense; the test split only reports. For every seed: train the dense
model (all masks one); from it, train three models for the same number
of epochs, pruning gradually and then with the masks fixed: DISCO
(`--selection`, saliency by default, at --comm_ratio), random selection
at the same ratio, and no communication (ratio 0). With `--sweep`, the
first seed's dense model is also pruned to every ratio with every
selection (saliency, gates, magnitude, random): quality against bytes per
inference, one curve per selection, `sweep_<task>.png`.

`results.json`: `metric` (accuracy, psnr, miou or map50), `quality_<v>`
(test, mean over seeds) and `quality_<v>_per_seed` for v in dense, disco,
random, no_comm, the same on validation, `paired_disco_minus_random`
(DISCO - random per seed, paired by seed: mean, 95% t interval, seeds),
`comm_bytes_dense` /
`comm_bytes_disco` (one inference of one image, from the masks), costs of
the first seed's DISCO model, `sweep` rows and the `chosen` ratio;
super-resolution adds SSIM and the bicubic baseline; `budget` is the
budget used and `budget_validation` each candidate's validation quality,
bytes and whether they fit the ratio's bytes (the no-communication
model's plus ratio x the rest of dense), where there were several;
`comm_bytes_random` the random arm's bytes (first seed),
`comm_bytes_disco_per_seed` and `comm_bytes_random_per_seed` each seed's.
One checkpoint per
seed (`disco_seed<N>/`, read by `disco.checkpoint.load`).

Flags left out take the task's measured settings
(`experiments.disco_settings.TASK_SETTINGS`, the runs of
docs/experiments/disco_train.md's "Every task" table), else the digits run's
defaults; `--dataset` defaults to the task's first dataset.
"""

import dataclasses
import os
import sys
import time

import numpy as np
from absl import app, flags
from flax import nnx

from disco import checkpoint, data, metrics, prune, tasks, train
from disco.errors import DiscoError
from experiments import common, disco_settings
from experiments.disco_settings import Settings

VARIANTS = ("dense", "disco", "random", "no_comm")


def define_flags() -> None:
  """One flag per setting, --out (`experiments.disco_settings`)."""
  disco_settings.define_flags()


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
  ratios = settings.ratios()
  dataset = data.load(
    settings.task,
    settings.dataset,
    image_size=settings.image_size,
    test_fraction=settings.test_fraction,
    data_dir=settings.data_dir,
    scale=settings.scale,
    patches=settings.patches,
    scenes=settings.scenes,
  )
  validation = data.holdout(dataset, settings.validation_fraction)
  common.log(
    f"{dataset.name}: {len(validation.x_train)} train / "
    f"{len(validation.x_test)} validation / {len(dataset.x_test)} test "
    f"examples of shape {dataset.image_shape}"
  )
  seeds = range(settings.first_seed, settings.first_seed + settings.seeds)
  rates = settings.learning_rate_list()
  extra_budgets = len(settings.budget_list()) - 1
  runs = (
    len(rates)
    + 4 * len(seeds)
    - 1
    + len(prune.SELECTIONS) * len(ratios)
    + extra_budgets
  )
  progress = common.Progress(runs, "training run")
  experiment = _Experiment(settings, dataset, validation, progress)
  learning_rate, first_dense = experiment.choose_learning_rate(rates)
  budget, first_pruned, by_budget = experiment.choose_budget(
    first_dense, settings.first_seed
  )
  scores = {name: [] for name in VARIANTS}
  checkpoints, first_disco = [], None
  for seed in seeds:
    dense = first_dense if seed == seeds[0] else None
    if dense is None:
      dense = experiment.dense(seed, learning_rate)
    scores["dense"].append(experiment.evaluate(dense))
    variants = {
      "disco": (settings.comm_ratio, settings.selection),
      "random": (settings.comm_ratio, "random"),
      "no_comm": (0.0, "magnitude"),
    }
    for name, (ratio, selection) in variants.items():
      if name == "disco" and seed == seeds[0] and first_pruned is not None:
        model = first_pruned
      else:
        model = experiment.pruned(dense, ratio, selection, seed, name, budget)
      scores[name].append(experiment.evaluate(model))
      if name == "disco":
        folder = os.path.join(out, f"disco_seed{seed}")
        checkpoint.save(model, folder, data=settings.data_record())
        checkpoints.append(folder)
        if first_disco is None:
          first_disco = model
    if seed == seeds[0]:
      sweep = experiment.sweep(dense, ratios, seed, budget)
  results = _results(settings, scores, first_disco, sweep)
  results.update(
    comm_bytes_random=scores["random"][0]["bytes"],
    # The bytes budget fills r x the groups' bytes to within one group,
    # so the arms' bytes differ a little from seed to seed.
    comm_bytes_disco_per_seed=[v["bytes"] for v in scores["disco"]],
    comm_bytes_random_per_seed=[v["bytes"] for v in scores["random"]],
    learning_rate=learning_rate,
    budget=budget,
    budget_validation=by_budget,
    checkpoints=checkpoints,
  )
  if settings.task == "superres":
    results.update(
      tasks.bicubic_baseline(dataset.x_test, dataset.y_test, settings.scale)
    )
    results["quality_bicubic"] = results.pop("psnr")
    results["ssim_bicubic"] = results.pop("ssim")
  if sweep:
    results["plot"] = _plot(settings, results, out)
  results["wall_seconds"] = round(time.perf_counter() - started, 1)
  results["config"] = settings.record()
  path = common.write_results(out, results)
  common.log(f"wrote {path}")
  return results


class _Experiment:
  """Training runs and evaluation for one dataset and settings."""

  def __init__(self, settings, dataset, validation, progress):
    self.settings = settings
    self.dataset = dataset
    self.validation = validation
    self.progress = progress

  def choose_learning_rate(self, rates):
    """The dense learning rate best on validation, and its model."""
    best = None
    for rate in rates:
      model = self.dense(self.settings.first_seed, rate)
      score = self.evaluate(model)["validation"]
      common.log(f"learning rate {rate}: validation quality {score:.4f}")
      if best is None or score > best[0]:
        best = (score, rate, model)
    return best[1], best[2]

  def choose_budget(self, dense, seed):
    """(budget, its DISCO model or None, per budget its validation
    quality, bytes and whether they fit the ratio):
    with several `--budget`s, the DISCO arm pruned from the first seed's
    `dense` with each, the best on validation chosen (None: one budget,
    nothing trained here).

    The ratio's bytes are those the masks cannot remove (the outputs
    gathered to node 0: the no-communication model's) plus ratio x the
    bytes of all channel groups. The layer and bytes budgets stay within
    them; the global one counts groups, not bytes, and may keep groups of
    large tensors and send more. Such a candidate is left out (its quality
    is recorded): choosing it would buy quality with bytes, and the
    comparison with random is at the ratio's bytes."""
    s = self.settings
    budgets = s.budget_list()
    if len(budgets) == 1:
      return budgets[0], None, {}
    fixed = metrics.count(metrics.with_masks(dense, False)).bytes_sent
    full = metrics.count(metrics.with_masks(dense, True)).bytes_sent
    allowed = fixed + s.comm_ratio * (full - fixed)
    best, scores = None, {}
    for budget in budgets:
      name = f"disco, {budget} budget"
      model = self.pruned(dense, s.comm_ratio, s.selection, seed, name, budget)
      scored = self.evaluate(model)
      fits = scored["bytes"] <= allowed
      scores[budget] = dict(
        quality=scored["validation"], bytes=scored["bytes"], allowed=fits
      )
      common.log(
        f"budget {budget}: validation quality {scored['validation']:.4f}, "
        f"{scored['bytes']:,} bytes"
        + ("" if fits else f" over the ratio's {allowed:,.0f}: left out")
      )
      if fits and (best is None or scored["validation"] > best[0]):
        best = (scored["validation"], budget, model)
    return best[1], best[2], scores

  def dense(self, seed, learning_rate):
    """A dense model trained from scratch."""
    s = self.settings
    model = tasks.build(
      s.task,
      self.dataset,
      num_nodes=s.num_nodes,
      width=s.width,
      seed=seed,
      model=s.model,
      scale=s.scale,
    )
    self._fit(model, seed, None, s.dense_epochs, learning_rate)
    self.progress.step(f"seed {seed} dense")
    return model

  def pruned(self, dense, ratio, selection, seed, name, budget):
    """`dense` pruned gradually to `ratio` within `budget`, then
    fine-tuned."""
    s = self.settings
    model = nnx.clone(dense)
    config = train.TrainConfig(epochs=1, batch_size=s.batch_size)
    steps = s.prune_epochs * config.steps_per_epoch(
      len(self.validation.x_train)
    )
    schedule = prune.GradualSchedule(
      target_ratio=ratio,
      steps=max(steps, 1),
      every=s.prune_every,
      budget=budget,
      selection=selection,
      seed=seed,
    )
    epochs = s.prune_epochs + s.finetune_epochs
    self._fit(model, seed, schedule, epochs, s.finetune_learning_rate)
    self.progress.step(f"seed {seed} {name} (ratio {ratio}, {selection})")
    return model

  def _fit(self, model, seed, schedule, epochs, learning_rate):
    s = self.settings
    config = train.TrainConfig(
      epochs=epochs,
      batch_size=s.batch_size,
      learning_rate=learning_rate,
      weight_decay=s.weight_decay,
      group_lasso=s.group_lasso,
    )
    train.fit(
      model,
      self.validation.x_train,
      self.validation.y_train,
      config,
      seed=seed,
      schedule=schedule,
      loss=tasks.loss(model),
    )

  def evaluate(self, model) -> dict:
    """Test and validation quality (and SSIM for super-resolution)."""
    test = tasks.quality(model, self.dataset.x_test, self.dataset.y_test)
    scores = {
      "test": test,
      "validation": tasks.quality(
        model, self.validation.x_test, self.validation.y_test
      ),
      "bytes": metrics.count(model).bytes_sent,
    }
    if self.settings.task == "superres":
      outputs = tasks.predict(model, self.dataset.x_test)
      scores["ssim"] = tasks.ssim(outputs, self.dataset.y_test)
    common.log(
      f"quality {test:.4f} (validation {scores['validation']:.4f}), "
      f"comm ratio {prune.comm_ratio(model):.3f}"
    )
    return scores

  def sweep(self, dense, ratios, seed, budget) -> list:
    """One row per ratio and selection, from `dense`."""
    rows = []
    for ratio in ratios:
      for selection in prune.SELECTIONS:
        model = self.pruned(dense, ratio, selection, seed, "sweep", budget)
        scores = self.evaluate(model)
        rows.append(
          {
            "ratio": ratio,
            "selection": selection,
            "comm_bytes": scores["bytes"],
            "quality": scores["test"],
            "quality_validation": scores["validation"],
          }
        )
    return rows


def _results(settings, scores, model, sweep) -> dict:
  disco_report = metrics.count(model)
  dense_report = metrics.count(metrics.with_masks(model, True))
  single = metrics.single_device_summary(dense_report)
  disco_costs = disco_report.summary()
  results = {
    "metric": tasks.METRICS[settings.task],
    "task": settings.task,
    "dataset": settings.dataset,
    "definitions": {
      "quality_*": "test metric, mean over seeds (validation: *_validation)",
      "comm_bytes_*": "bytes between nodes for one inference of one example",
      "flops_*": "FLOPs for one example, all nodes together",
      "sweep": "from the first seed's dense model; quality is on test",
      "chosen": "smallest bytes within tolerance of dense on validation",
      "paired_disco_minus_random": "test quality of DISCO minus random, "
      "paired by seed (same dense model): mean and 95% t interval",
    },
    "selection": settings.selection,
  }
  for name, values in scores.items():
    results[f"quality_{name}"] = float(np.mean([v["test"] for v in values]))
    results[f"quality_{name}_per_seed"] = [v["test"] for v in values]
    validation = [v["validation"] for v in values]
    results[f"quality_{name}_validation"] = float(np.mean(validation))
    results[f"quality_{name}_validation_per_seed"] = validation
    if "ssim" in values[0]:
      results[f"ssim_{name}"] = float(np.mean([v["ssim"] for v in values]))
  results.update(
    comm_bytes_dense=dense_report.bytes_sent,
    comm_bytes_disco=disco_report.bytes_sent,
    comm_bytes_no_comm=metrics.count(
      metrics.with_masks(model, False)
    ).bytes_sent,
    flops_dense=single["flops"],
    flops_disco=disco_costs["flops"],
    params_per_node_dense=single["params_per_node"],
    params_per_node_channel_parallel=dense_report.summary()["params_per_node"],
    params_per_node_disco=disco_costs["params_per_node"],
    comm_ratio_measured=prune.comm_ratio(model),
    sweep=sweep,
  )
  results["paired_disco_minus_random"] = common.paired_interval(
    results["quality_disco_per_seed"], results["quality_random_per_seed"]
  )
  results["chosen"] = _choose(settings, results, sweep)
  return results


def _choose(settings, results, sweep):
  """The sweep row of fewest bytes within tolerance of dense on validation."""
  floor = results["quality_dense_validation_per_seed"][0] - settings.tolerance
  good = [r for r in sweep if r["quality_validation"] >= floor]
  if not good:
    return None
  row = min(good, key=lambda r: (r["comm_bytes"], -r["quality_validation"]))
  dense_test = results["quality_dense_per_seed"][0]
  dense_bytes = results["comm_bytes_dense"]
  return dict(
    row,
    # None where the chosen model sends nothing (one node, ratio 0): the
    # max(bytes, 1) printed 0x on one node and dense's bytes otherwise.
    bytes_reduction=dense_bytes / row["comm_bytes"]
    if row["comm_bytes"]
    else None,
    drop_from_dense_test=dense_test - row["quality"],
  )


def _plot(settings, results, out) -> str | None:
  try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    common.log("no matplotlib (the plots extra): no sweep plot")
    return None
  figure, axes = plt.subplots(figsize=(5, 3.5))
  markers = dict(saliency="o-", gates="D-", magnitude="^-", random="s--")
  for selection in prune.SELECTIONS:
    rows = [r for r in results["sweep"] if r["selection"] == selection]
    rows.sort(key=lambda r: r["comm_bytes"])
    label = selection if selection == "random" else f"DISCO ({selection})"
    marker = markers[selection]
    axes.plot(
      [max(r["comm_bytes"], 1) for r in rows],
      [r["quality"] for r in rows],
      marker,
      label=label,
    )
  axes.axhline(results["quality_dense_per_seed"][0], color="k", lw=0.8)
  axes.axhline(results["quality_no_comm_per_seed"][0], color="r", lw=0.8)
  axes.set_xscale("log")
  axes.set_xlabel("bytes between nodes per inference")
  axes.set_ylabel(f"test {results['metric']}")
  axes.set_title(
    f"{settings.task} / {settings.dataset}: dense (black), no comm (red)"
  )
  axes.legend()
  figure.tight_layout()
  path = os.path.join(out, f"sweep_{settings.task}.png")
  figure.savefig(path, dpi=120)
  plt.close(figure)
  return path


_HEADLINE = (
  "metric",
  "quality_dense",
  "quality_disco",
  "quality_random",
  "quality_no_comm",
  "comm_bytes_dense",
  "comm_bytes_disco",
  "paired_disco_minus_random",
  "chosen",
  "wall_seconds",
)


def main(argv):
  common.start(argv)
  given = {
    f.name: flags.FLAGS[f.name].value
    for f in dataclasses.fields(Settings)
    if flags.FLAGS[f.name].present and f.name != "task"
  }
  try:
    settings = Settings.for_task(flags.FLAGS.task, **given)
    read = settings.record().items()
    common.log("settings: " + ", ".join(f"{k}={v!r}" for k, v in read))
    results = run(settings, flags.FLAGS.out)
  except DiscoError as error:
    sys.exit(f"disco_train: error: {error}")
  # The bicubic baseline where there is one (super-resolution): a model
  # below it has learnt nothing an interpolation does not give.
  for key in _HEADLINE + ("quality_bicubic",):
    if key in results:
      print(f"{key}: {results[key]}")


if __name__ == "__main__":
  define_flags()
  app.run(main)
