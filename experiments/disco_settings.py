"""The settings of `experiments.disco_train`: one dataclass, one flag each.

`Settings` defaults are the digits run; `TASK_SETTINGS` holds, per task and
dataset, the settings of the runs docs/experiments/disco_train.md reports,
which the command line uses for every flag it is not given
(`Settings.for_task`).
"""

import dataclasses

from absl import flags

from disco import checkpoint, data, prune
from disco.errors import DataError, DiscoError, require_int, require_number
from experiments import common


@dataclasses.dataclass(frozen=True)
class Settings:
  """Everything one run depends on; the defaults are the digits run.

  Example:
    >>> Settings(seeds=1).width
    8

  Args:
    task: "classify", "superres", "segment" or "detect".
    model: the classifier, "resnet" or "vit" (other tasks have one).
    dataset: a dataset of the task (`disco.data.TASKS`).
    data_dir: the CIFAR-10 python batch folder.
    image_size: side of the classification images.
    test_fraction: share of digits / mnist held out for testing.
    validation_fraction: share of the training split held out to choose.
    scale: super-resolution factor.
    patches: super-resolution training patches.
    scenes: shape scenes (a quarter for testing).
    width: the model's base width.
    num_nodes: nodes every layer is split over.
    comm_ratio: kept cross-node channel groups of the DISCO model.
    sweep: comma-separated ratios for the quality-vs-bytes sweep.
    tolerance: largest validation drop from dense the sweep's choice may
      have (metric units).
    budget: the DISCO arm's pruning budget, "layer", "global" or "bytes"
      (`disco.prune.to_ratio`); several, comma-separated, choose on
      validation (first seed).
    selection: how the DISCO arm chooses the channel groups it keeps:
      saliency (loss change measured while pruning), magnitude or random.
    seeds: number of seeds.
    first_seed: seeds first_seed .. first_seed + seeds - 1.
    dense_epochs: epochs of dense training.
    prune_epochs: epochs of gradual pruning (from the dense model).
    finetune_epochs: epochs with the masks fixed, after pruning.
    prune_every: training steps between pruning updates.
    batch_size: examples per step.
    learning_rates: comma-separated peak learning rates of dense training;
      the best on validation is used.
    finetune_learning_rate: peak learning rate of pruning + fine-tuning.
    weight_decay: AdamW weight decay.
    group_lasso: weight of the group-lasso term while pruning.
  """

  task: str = "classify"
  model: str = "resnet"
  dataset: str = "digits"
  data_dir: str = ""
  image_size: int = 16
  test_fraction: float = 0.4
  validation_fraction: float = 0.15
  scale: int = 2
  patches: int = 2000
  scenes: int = 2000
  width: int = 8
  num_nodes: int = 2
  comm_ratio: float = 0.2
  sweep: str = ""
  tolerance: float = 0.01
  budget: str = "layer"
  selection: str = "saliency"
  seeds: int = 3
  first_seed: int = 0
  dense_epochs: int = 30
  prune_epochs: int = 15
  finetune_epochs: int = 15
  prune_every: int = 5
  batch_size: int = 64
  learning_rates: str = "0.003"
  finetune_learning_rate: float = 1e-3
  weight_decay: float = 1e-4
  group_lasso: float = 1e-3

  def __post_init__(self):
    """Counts, rates and shares out of range are refused here, before a
    run starts (they failed deep inside it, or ran on silently)."""
    least = {
      "seeds": 1,
      "first_seed": 0,
      "dense_epochs": 1,
      "prune_epochs": 1,  # the pruning schedule needs steps
      "finetune_epochs": 0,
      "prune_every": 1,
      "batch_size": 1,
      "patches": 1,
      "scenes": 1,
    }
    for name, low in least.items():
      require_int(name, getattr(self, name), low, DiscoError)
    for name in ("tolerance", "finetune_learning_rate"):
      require_number(name, getattr(self, name), error=DiscoError)
    if not 0 < self.validation_fraction < 1:
      raise DiscoError(
        f"validation_fraction must be in (0, 1), got {self.validation_fraction}"
      )
    self.learning_rate_list()
    self.budget_list()
    self.ratios()

  def budget_list(self) -> list[str]:
    """The pruning budgets to choose from, checked (at least one, each of
    `disco.prune.BUDGETS`, none twice).

    Example:
      >>> Settings(budget="layer,global").budget_list()
      ['layer', 'global']
    """
    budgets = [v.strip() for v in self.budget.split(",")]
    if not all(b in prune.BUDGETS for b in budgets) or len(set(budgets)) != len(
      budgets
    ):
      raise DiscoError(
        f"budget takes one or more of {', '.join(prune.BUDGETS)} "
        f"separated by commas, each once, got {self.budget!r}"
      )
    return budgets

  def learning_rate_list(self) -> list[float]:
    """The dense learning rates, checked (at least one, each > 0)."""
    try:
      rates = [float(v) for v in self.learning_rates.split(",")]
    except ValueError:
      raise DiscoError(
        "learning_rates takes numbers separated by commas, got "
        f"{self.learning_rates!r}"
      ) from None
    for rate in rates:
      require_number("each of learning_rates", rate, True, DiscoError)
    return rates

  @classmethod
  def for_task(cls, task: str, dataset: str | None = None, **given):
    """The measured settings of `task` (docs/experiments/disco_train.md),
    then `given` on top.

    A task's first dataset is its default. Settings a task has no entry
    for in `TASK_SETTINGS` are the dataclass defaults (the digits run).

    Example:
      >>> s = Settings.for_task("superres")
      >>> s.dataset, s.num_nodes, s.group_lasso
      ('photos', 3, 0.0)
      >>> Settings.for_task("superres", num_nodes=2).num_nodes
      2
    """
    if task not in data.TASKS:
      raise DiscoError(
        f"unknown task {task!r}; tasks: {', '.join(sorted(data.TASKS))}"
      )
    dataset = dataset or data.TASKS[task][0]
    # A setting its task or dataset never reads was recorded as if used
    # (CIFAR-10 trained at 32x32 and recorded --image_size=16).
    for name in given:
      for only, used_by in ((_ONLY_FOR, task), (_DATASET_ONLY, dataset)):
        readers = only.get(name, (used_by,))
        if used_by not in readers:
          raise DiscoError(
            f"--{name} applies to {' and '.join(readers)}, not {used_by} "
            "(it would be recorded and not used)"
          )
    measured = TASK_SETTINGS.get((task, dataset), {})
    return cls(task=task, dataset=dataset, **{**measured, **given})

  def record(self) -> dict:
    """The settings as results.json records them: those the task reads.

    Example:
      >>> record = Settings.for_task("superres").record()
      >>> "scale" in record, "model" in record, "scenes" in record
      (True, False, False)
    """
    return {
      name: value
      for name, value in dataclasses.asdict(self).items()
      if self.task in _ONLY_FOR.get(name, (self.task,))
      and self.dataset in _DATASET_ONLY.get(name, (self.dataset,))
    }

  def data_record(self) -> dict:
    """The settings that choose the data and its held-out split, as the
    checkpoints record them (`disco.checkpoint.data_settings`), so that
    `experiments.disco_infer` scores the same held-out images.

    Example:
      >>> record = Settings(test_fraction=0.2).data_record()
      >>> record["dataset"], record["test_fraction"], "scale" in record
      ('digits', 0.2, False)
    """
    record = self.record()
    names = ("task", "dataset", *data.OPTION_NAMES)
    return {name: record[name] for name in names if name in record}

  def ratios(self) -> list[float]:
    """The sweep's ratios, checked."""
    try:
      values = [float(v) for v in self.sweep.split(",") if v.strip()]
    except ValueError:
      raise DiscoError(
        f"sweep takes ratios separated by commas, got {self.sweep!r}"
      ) from None
    for value in values:
      prune.check_ratio(value)
    return values


# Settings only some tasks read (`disco.data.load`'s options, the
# classifier's architecture).
_ONLY_FOR = {
  "model": ("classify",),
  "image_size": ("classify",),
  "test_fraction": ("classify",),
  "data_dir": ("classify",),
  "scale": ("superres",),
  "patches": ("superres",),
  "scenes": ("segment", "detect"),
}


# Settings only some datasets read: CIFAR-10 keeps its 32x32 images and
# its own test batch (its image size and test fraction were recorded, and
# not used); only it reads a folder.
_DATASET_ONLY = {
  "image_size": ("digits", "mnist", "synthetic"),
  "test_fraction": ("digits", "mnist"),
  "data_dir": ("cifar10",),
}


# Per (task, dataset), the settings of the runs docs/experiments/disco_train.md
# reports (its "Every task" table): the schedules each task needs to separate
# the variants, measured on the 2-core development machine. Super-resolution
# runs on 3 nodes without the group-lasso term (on 2 nodes no communication is
# within 0.3 dB of dense; the term costs PSNR there).
TASK_SETTINGS = {
  # 4 nodes at width 8, where sending matters: no communication is 23-30
  # points below dense (at 2 nodes and width 16 it was 0.45, and the
  # selections could not be ranked). Short recovery (5 + 5 epochs) keeps
  # what the selection chose from being trained away.
  ("classify", "mnist"): dict(
    width=8,
    num_nodes=4,
    dense_epochs=10,
    prune_epochs=5,
    finetune_epochs=5,
    seeds=5,
    tolerance=0.01,
  ),
  ("superres", "photos"): dict(
    patches=2000,
    width=18,
    num_nodes=3,
    batch_size=16,
    dense_epochs=8,
    prune_epochs=3,
    finetune_epochs=3,
    seeds=2,
    learning_rates="0.002",
    tolerance=0.1,
    group_lasso=0.0,
  ),
  # The bytes budget: the layer budget's floors leave 0.057 of the groups
  # at r = 0.1 (0.007 at 0.05) and random selection recovered all but 0.7
  # mIoU points of saliency's gain; spending r x the bytes where saliency
  # per byte is highest, saliency led random by 2.1 and 3.4 points on 2
  # seeds (2026-12-06).
  ("segment", "shapes"): dict(
    budget="bytes",
    scenes=2000,
    width=8,
    batch_size=8,
    dense_epochs=30,
    prune_epochs=10,
    finetune_epochs=20,
    seeds=2,
    tolerance=0.02,
  ),
  # Budget chosen on validation: bytes won on 2026-12-06 (0.764 against
  # the layer budget's 0.712 on seed 0, r = 0.1).
  ("detect", "shapes"): dict(
    budget="layer,bytes",
    scenes=2000,
    width=8,
    batch_size=8,
    dense_epochs=30,
    prune_epochs=15,
    finetune_epochs=40,
    seeds=4,
    tolerance=0.02,
  ),
}


def held_out_split(
  folder: str, dataset: str | None, test_fraction: float | None
) -> tuple[str, dict]:
  """(dataset, `disco.data.load` options) of the held-out split the
  checkpoint in `folder` was trained with (`Settings.data_record`).

  `dataset` / `test_fraction` other than the recorded ones would score
  images the model was trained on (half of digits' held-out images for
  0.4 against 0.2), so they are refused; None takes the recorded one.
  Without a record (older checkpoints): the arguments, else digits and
  the dataset's default split, said in the log.

  Raises:
    DataError: an argument that differs from the record.
  """
  recorded = checkpoint.data_settings(folder) or {}
  name = dataset or recorded.get("dataset", "digits")
  given = {"dataset": dataset, "test_fraction": test_fraction}
  for key, value in given.items():
    if value is not None and key in recorded and recorded[key] != value:
      raise DataError(
        f"{folder} was trained with {key}={recorded[key]!r}; --{key}="
        f"{value!r} would score images it was trained on: leave the flag "
        "out to use the recorded one"
      )
  fraction = test_fraction or recorded.get("test_fraction")
  if not recorded:
    split = f"test_fraction {fraction}" if fraction else "its default split"
    common.log(
      f"{folder} records no data settings: scoring {name} with {split}; "
      "pass the dataset and test fraction it was trained with"
    )
  options = {}
  if fraction is not None and name in _DATASET_ONLY["test_fraction"]:
    options["test_fraction"] = fraction
  return name, options


def define_flags() -> None:
  """One flag per setting (help from the `Settings` docstring), --out."""
  choices = {
    "task": sorted(data.TASKS),
    "model": ["resnet", "vit"],
    "dataset": sorted({n for names in data.TASKS.values() for n in names}),
    "selection": list(prune.SELECTIONS),
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
  common.define_out()
  common.define_flags()
