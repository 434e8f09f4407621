"""Cost models: how long nodes, transfers, all-reduces and updates take.

Planners and the simulator ask a cost model (the `CostModel` protocol of
`graphpipe.plan`) for times in seconds. Two implementations:

- `AnalyticCostModel(device_spec('v100'))`: a roofline per node from its
  FLOPs and bytes, with an efficiency that falls for small micro-batches,
  and affine (latency + bytes / bandwidth) communication.
- `ProfiledCostModel(graph, analytic)`: each node's jitted forward and
  backward timed on the actual device at a few micro-batch sizes (cached on
  disk), interpolated in between; communication from the analytic model.

On top of any cost model, `StageCosts` prices candidate stages for the
planners (time per sample, in-flight capacity under the memory rule) and
`estimate_iteration_time` prices a whole plan.

The efficiency curve. A GPU kernel reaches its peak only when it has enough
independent work to fill every core: a GEMM is tiled over its outputs, and
a call whose output has few tiles leaves streaming multiprocessors idle
(NVIDIA, "Matrix Multiplication Background User's Guide": tile and wave
quantization). We model the fraction of peak a node's call reaches as

  efficiency(E) = max_efficiency * E / (E + half_efficiency_elements)

where E is the number of elements the call writes (its output bytes / 4,
per sample times the per-device micro-batch). `half_efficiency_elements`
grows with the number of cores: 1,440 elements per streaming
multiprocessor. That constant is calibrated on the paper's case study
(PAPERS.md): it attributes half of a 20% gain to micro-batch 4 instead of
2, i.e. a transformer block (seq 256, hidden 1024) about 10% faster per
sample at 4 than at 2, which this curve gives with E = 262,144 elements
per sample and 80 V100 SMs:
(1 + 115200 / 524288) / (1 + 115200 / 1048576) = 1.099. The same curve puts
a 4096-wide feed-forward layer at 53% of max efficiency at micro-batch 32
and 90% at 256, which is why larger micro-batches pay off most for the MLP
models. `max_efficiency` (0.8) is the share of peak that large cuBLAS GEMMs
sustain across a whole layer. Kernels with tiny outputs (reductions, the
loss) are floored at 2% of max efficiency so that they are not charged as
if they ran on one core.

Node time = max(FLOPs / (peak * efficiency), bytes / (bandwidth *
memory_efficiency)): the slower of compute and memory traffic. Bytes are
XLA's count before fusion, an overestimate that only matters for nodes
without matrix work.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from graphpipe.errors import GraphpipeError
from graphpipe.graph import Node, OpGraph
from graphpipe.plan import CostModel, Plan, stage_memory_bytes

# Elements per streaming multiprocessor at which a kernel reaches half its
# peak efficiency (calibrated on the paper's case study, module docstring).
_HALF_EFFICIENCY_ELEMENTS_PER_SM = 1440
# Adam's update reads parameters, gradients and two moments and writes the
# parameters and the moments: 7 passes over the parameter bytes.
_ADAM_PASSES = 7
# Kernels never run slower than this share of max efficiency (reductions
# and losses have tiny outputs but spread their inputs over the device).
_MIN_EFFICIENCY_SHARE = 0.02
_BYTES_PER_ELEMENT = 4


class CostModelError(GraphpipeError):
  """A device preset, dtype or profile that the cost model cannot use."""


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
  """One accelerator and its links, as the analytic cost model sees it.

  Example:
    >>> spec = device_spec("v100")
    >>> spec.peak_flops["float32"] / 1e12, spec.devices_per_node
    (15.7, 4)
    >>> dataclasses.replace(spec, memory_bytes=32 * 2**30)

  Args:
    name: preset name, e.g. 'v100'.
    peak_flops: peak FLOP/s by compute dtype ('float32', 'bfloat16', ...).
    memory_bandwidth: device memory bandwidth, bytes/s.
    memory_bytes: memory capacity of one device, bytes.
    intra_node_bandwidth: point-to-point bandwidth between two devices of
      the same node (one direction), bytes/s.
    intra_node_latency: latency of such a transfer, seconds.
    inter_node_bandwidth: bandwidth between devices of different nodes
      (one direction, per device), bytes/s.
    inter_node_latency: latency of such a transfer, seconds.
    devices_per_node: devices that share the fast link; device d lives on
      node d // devices_per_node.
    max_efficiency: share of peak that large matrix products sustain.
    half_efficiency_elements: output elements per call at which a kernel
      reaches half of `max_efficiency` (see the module docstring).
    memory_efficiency: share of `memory_bandwidth` streaming kernels reach.
    source: where the figures come from.
  """

  name: str
  peak_flops: dict[str, float]
  memory_bandwidth: float
  memory_bytes: float
  intra_node_bandwidth: float
  intra_node_latency: float
  inter_node_bandwidth: float
  inter_node_latency: float
  devices_per_node: int
  max_efficiency: float = 0.8
  half_efficiency_elements: float = 80 * _HALF_EFFICIENCY_ELEMENTS_PER_SM
  memory_efficiency: float = 0.8
  source: str = ""


def _gpu_presets() -> dict[str, DeviceSpec]:
  return {
    "v100": DeviceSpec(
      name="v100",
      peak_flops={"float32": 15.7e12, "float16": 125e12},
      memory_bandwidth=900e9,
      memory_bytes=16160 * 2**20,
      intra_node_bandwidth=50e9,
      intra_node_latency=5e-6,
      inter_node_bandwidth=12.5e9,
      inter_node_latency=10e-6,
      devices_per_node=4,
      half_efficiency_elements=80 * _HALF_EFFICIENCY_ELEMENTS_PER_SM,
      source=(
        "NVIDIA V100 SXM2 16 GB datasheet (15.7 TFLOP/s fp32, 125 fp16 "
        "tensor, 900 GB/s HBM2, 80 SMs); the paper's Summit-style node: 4 "
        "GPUs on NVLink 2.0 (2 bricks, 50 GB/s a direction), 100 Gb/s "
        "InfiniBand EDR between nodes"
      ),
    ),
    "a100": DeviceSpec(
      name="a100",
      peak_flops={
        "float32": 19.5e12,
        "tfloat32": 156e12,
        "bfloat16": 312e12,
        "float16": 312e12,
      },
      memory_bandwidth=2039e9,
      memory_bytes=81920 * 2**20,
      intra_node_bandwidth=300e9,
      intra_node_latency=5e-6,
      inter_node_bandwidth=25e9,
      inter_node_latency=10e-6,
      devices_per_node=8,
      half_efficiency_elements=108 * _HALF_EFFICIENCY_ELEMENTS_PER_SM,
      source=(
        "NVIDIA A100 SXM4 80 GB datasheet (dense peaks, 2,039 GB/s, 108 "
        "SMs); DGX A100: NVLink 3 (600 GB/s both ways), one 200 Gb/s HDR "
        "InfiniBand port per GPU"
      ),
    ),
    "h100": DeviceSpec(
      name="h100",
      peak_flops={
        "float32": 67e12,
        "tfloat32": 494.7e12,
        "bfloat16": 989.4e12,
        "float16": 989.4e12,
      },
      memory_bandwidth=3350e9,
      memory_bytes=81559 * 2**20,
      intra_node_bandwidth=450e9,
      intra_node_latency=5e-6,
      inter_node_bandwidth=50e9,
      inter_node_latency=10e-6,
      devices_per_node=8,
      half_efficiency_elements=132 * _HALF_EFFICIENCY_ELEMENTS_PER_SM,
      source=(
        "NVIDIA H100 SXM5 80 GB datasheet (dense peaks, 3.35 TB/s, 132 "
        "SMs); DGX H100: NVLink 4 (900 GB/s both ways), one 400 Gb/s NDR "
        "InfiniBand port per GPU"
      ),
    ),
    "h200": DeviceSpec(
      name="h200",
      peak_flops={
        "float32": 67e12,
        "tfloat32": 494.7e12,
        "bfloat16": 989.4e12,
        "float16": 989.4e12,
      },
      memory_bandwidth=4800e9,
      memory_bytes=143771 * 2**20,
      intra_node_bandwidth=450e9,
      intra_node_latency=5e-6,
      inter_node_bandwidth=50e9,
      inter_node_latency=10e-6,
      devices_per_node=8,
      half_efficiency_elements=132 * _HALF_EFFICIENCY_ELEMENTS_PER_SM,
      source=(
        "NVIDIA H200 SXM 141 GB datasheet (H100 compute, 4.8 TB/s HBM3e, "
        "143,771 MiB as nvidia-smi reports); HGX H200: NVLink 4, one 400 "
        "Gb/s NDR InfiniBand port per GPU"
      ),
    ),
  }


PRESETS = ("v100", "a100", "h100", "h200", "cpu")


def device_spec(name: str) -> DeviceSpec:
  """The preset `DeviceSpec` called `name`.

  'cpu' is measured on this machine (a timed matmul at two sizes and a
  memory copy, well under a second, once per process); the GPU presets are
  datasheet figures (see each spec's `source`).

  Example:
    >>> device_spec("h100").memory_bytes / 2**30
    79.6...

  Args:
    name: one of `PRESETS` (case-insensitive).

  Raises:
    CostModelError: `name` is not a preset.
  """
  key = name.lower()
  if key == "cpu":
    return measure_cpu()
  presets = _gpu_presets()
  if key not in presets:
    raise CostModelError(
      f"unknown device preset {name!r}; known presets: "
      f"{', '.join(PRESETS)} (or build a DeviceSpec yourself)"
    )
  return presets[key]


def _best_time(fn: Callable, *args, repeats: int = 5) -> float:
  """The fastest of `repeats` timed calls of jitted `fn` (after a warm-up)."""
  jax.block_until_ready(fn(*args))
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    best = min(best, time.perf_counter() - start)
  return best


# Measured once per process: the machine does not change while it runs, and
# every `device_spec('cpu')` call must agree with the previous ones.
@functools.cache
def measure_cpu() -> DeviceSpec:
  """A `DeviceSpec` for this machine's CPU devices, from a short benchmark.

  Times float32 matmuls of 128 and 512 squared (their ratio gives the
  half-efficiency size of the curve, the large one the peak) and a 32 MiB
  elementwise pass (memory bandwidth). The simulated JAX devices share the
  host's memory, so each gets an equal share of it; transfers between them
  are memory copies.

  Example:
    >>> spec = measure_cpu()
    >>> spec.peak_flops["float32"] > 1e9
    True
  """
  matmul = jax.jit(jnp.matmul)
  rates = {}
  for n in (128, 512):
    a = jnp.ones((n, n), jnp.float32)
    rates[n] = 2 * n**3 / _best_time(matmul, a, a)
  small, large = 128.0**2, 512.0**2
  slowdown = max(rates[512] / rates[128], 1.0)
  # Solve efficiency(small) / efficiency(large) = 1 / slowdown for the
  # half-efficiency size h of the curve E / (E + h).
  denom = 1.0 / small - slowdown / large
  half = max((slowdown - 1.0) / denom, 0.0) if denom > 0 else large
  peak = rates[512] * (large + half) / large
  x = jnp.ones((8 * 2**20,), jnp.float32)
  copy_bw = 2 * x.nbytes / _best_time(jax.jit(lambda v: v + 1.0), x)
  host_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  num_devices = max(jax.local_device_count("cpu"), 1)
  return DeviceSpec(
    name="cpu",
    peak_flops={"float32": peak, "bfloat16": peak, "float16": peak},
    memory_bandwidth=copy_bw,
    memory_bytes=host_bytes / num_devices,
    intra_node_bandwidth=copy_bw / 2,
    intra_node_latency=10e-6,
    inter_node_bandwidth=copy_bw / 2,
    inter_node_latency=10e-6,
    devices_per_node=num_devices,
    max_efficiency=1.0,
    half_efficiency_elements=half,
    memory_efficiency=1.0,
    source=(
      f"measured on this host: {rates[512] / 1e9:.3g} GFLOP/s at 512^2, "
      f"{rates[128] / 1e9:.3g} at 128^2, copy {copy_bw / 1e9:.3g} GB/s, "
      f"{num_devices} JAX CPU devices sharing {host_bytes / 2**30:.3g} GiB"
    ),
  )


class AnalyticCostModel:
  """Roofline node times and affine communication for a `DeviceSpec`.

  See the module docstring for the efficiency curve and its calibration.

  Example:
    >>> model = AnalyticCostModel(device_spec("v100"))
    >>> model.node_time(graph.nodes[3], batch=4, kind="fwd")
    >>> model.transfer_time(2**20, src=0, dst=5)   # crosses nodes
    >>> model.allreduce_time(256e6, devices=range(8))

  Args:
    spec: the device and its links.
    dtype: compute dtype, a key of `spec.peak_flops`.
  """

  def __init__(self, spec: DeviceSpec, dtype: str = "float32"):
    if dtype not in spec.peak_flops:
      raise CostModelError(
        f"device {spec.name!r} has no peak for dtype {dtype!r}; choose one "
        f"of {sorted(spec.peak_flops)}"
      )
    self.spec = spec
    self.dtype = dtype
    self.name = spec.name
    self.memory_bytes = float(spec.memory_bytes)
    self._peak = spec.peak_flops[dtype] * spec.max_efficiency
    self._bandwidth = spec.memory_bandwidth * spec.memory_efficiency

  def __repr__(self) -> str:
    return f"AnalyticCostModel({self.spec.name!r}, dtype={self.dtype!r})"

  def efficiency(self, output_elements: float) -> float:
    """Share of peak a call writing `output_elements` reaches."""
    spec = self.spec
    curve = output_elements / (output_elements + spec.half_efficiency_elements)
    return spec.max_efficiency * max(curve, _MIN_EFFICIENCY_SHARE)

  def node_time(self, node: Node, batch: float, kind: str) -> float:
    """Seconds for `node`'s forward ('fwd') or backward ('bwd') pass.

    Args:
      node: the operator node.
      batch: samples the device processes (may be fractional: a share of a
        micro-batch).
      kind: 'fwd' or 'bwd'.
    """
    if kind not in ("fwd", "bwd"):
      raise CostModelError(f"kind must be 'fwd' or 'bwd', got {kind!r}")
    flops = node.cost(f"{kind}_flops", batch)
    num_bytes = node.cost(f"{kind}_bytes", batch)
    elements = node.cost("activation_bytes", batch) / _BYTES_PER_ELEMENT
    compute = 0.0
    if flops > 0:
      peak = self.spec.peak_flops[self.dtype]
      compute = flops / (peak * self.efficiency(elements))
    return max(compute, num_bytes / self._bandwidth)

  def _link(self, src: int, dst: int) -> tuple[float, float]:
    """(bandwidth, latency) of the link between two devices."""
    per_node = self.spec.devices_per_node
    if src // per_node == dst // per_node:
      return self.spec.intra_node_bandwidth, self.spec.intra_node_latency
    return self.spec.inter_node_bandwidth, self.spec.inter_node_latency

  def transfer_time(self, num_bytes: float, src: int, dst: int) -> float:
    """Latency + bytes / bandwidth of the link from src to dst (0 if same)."""
    if src == dst or num_bytes <= 0:
      return 0.0
    bandwidth, latency = self._link(src, dst)
    return latency + num_bytes / bandwidth

  def allreduce_time(self, num_bytes: float, devices: Sequence[int]) -> float:
    """Ring all-reduce: 2 (k - 1) steps of num_bytes / k on the slowest link.

    Example:
      >>> model.allreduce_time(1e9, [0, 1, 2, 3])  # 1.5 GB over NVLink
    """
    devices = list(devices)
    k = len(devices)
    if k <= 1 or num_bytes <= 0:
      return 0.0
    nodes = {d // self.spec.devices_per_node for d in devices}
    if len(nodes) > 1:
      bandwidth = self.spec.inter_node_bandwidth
      latency = self.spec.inter_node_latency
    else:
      bandwidth = self.spec.intra_node_bandwidth
      latency = self.spec.intra_node_latency
    steps = 2 * (k - 1)
    return steps * (latency + num_bytes / k / bandwidth)

  def optimizer_time(self, param_bytes: float) -> float:
    """Adam's update: 7 memory passes over the parameter bytes."""
    return _ADAM_PASSES * param_bytes / self._bandwidth


def graph_fingerprint(graph: OpGraph) -> str:
  """A short hash of a graph's structure and costs (not its program).

  Plans and profiles record it so that they are never reused for another
  graph.

  Example:
    >>> graph_fingerprint(graph)
    'a3f9c1d2e4b5f607'

  Args:
    graph: the operator graph.
  """
  data = {
    "nodes": [dataclasses.asdict(n) for n in graph.nodes],
    "edges": [dataclasses.asdict(e) for e in graph.edges],
    "loss_nodes": list(graph.loss_nodes),
  }
  text = json.dumps(data, sort_keys=True, default=str)
  return hashlib.sha256(text.encode()).hexdigest()[:16]


def _random_inputs(avals, seed: int) -> list:
  """Arrays shaped like `avals`: normal floats, zero integers (indices)."""
  key = jax.random.key(seed)
  out = []
  for i, aval in enumerate(avals):
    if jnp.issubdtype(aval.dtype, jnp.inexact):
      out.append(
        jax.random.normal(jax.random.fold_in(key, i), aval.shape, aval.dtype)
      )
    else:
      out.append(jnp.zeros(aval.shape, aval.dtype))
  return out


def _fwd_bwd(node_fn, avals):
  """Jitted forward and forward+backward of a node program."""
  wrt = [jnp.issubdtype(a.dtype, jnp.inexact) for a in avals]

  def forward(*args):
    return node_fn(*args)

  def backward(*args):
    fixed = [a for a, w in zip(args, wrt, strict=True) if not w]
    diff = [a for a, w in zip(args, wrt, strict=True) if w]

    def differentiable(*diff_in):
      it_diff, it_fixed = iter(diff_in), iter(fixed)
      outs = node_fn(*[next(it_diff) if w else next(it_fixed) for w in wrt])
      return tuple(
        o for o in outs if jnp.issubdtype(jnp.result_type(o), jnp.inexact)
      )

    outs, vjp = jax.vjp(differentiable, *diff)
    return outs, vjp(tuple(jnp.ones_like(o) for o in outs))

  return jax.jit(forward), jax.jit(backward), any(wrt)


def _interpolate(sizes: Sequence[float], times: Sequence[float], x: float):
  """Piecewise-linear in the batch, extrapolated from the nearest segment."""
  if len(sizes) == 1:
    return times[0] * x / sizes[0]
  i = int(np.clip(np.searchsorted(sizes, x), 1, len(sizes) - 1))
  x0, x1, y0, y1 = sizes[i - 1], sizes[i], times[i - 1], times[i]
  value = y0 + (x - x0) * (y1 - y0) / (x1 - x0)
  # Below the smallest measured size time cannot fall faster than the
  # batch: keep at least the proportional share of the smallest time.
  return max(value, times[0] * min(x / sizes[0], 1.0))


class ProfiledCostModel:
  """Node times measured on the actual device; the rest from `analytic`.

  Each node's jitted forward and backward run on random inputs at every
  size in `batch_sizes`; the fastest of a few runs counts (backward = the
  timed forward+backward minus the forward). Times are cached as JSON in
  `cache_dir`, keyed by graph fingerprint and device kind, and interpolated
  piecewise-linearly in the batch. Transfers, all-reduces, optimizer steps
  and memory capacity come from the analytic model.

  Needs a captured graph (`graph.program`); a graph loaded from JSON can
  still use a cache written earlier for the same graph and device.

  Example:
    >>> model = ProfiledCostModel(graph, AnalyticCostModel(device_spec("h200")))
    >>> plan = planner.plan(graph, 8, 64, cost_model=model)

  Args:
    graph: the operator graph to profile.
    analytic: communication, optimizer and memory figures.
    batch_sizes: micro-batch sizes to time at (powers of two work best).
    cache_dir: folder of the JSON cache (None: no cache).
    repeats: timed runs per node and size.
  """

  def __init__(
    self,
    graph: OpGraph,
    analytic: AnalyticCostModel,
    batch_sizes: Sequence[int] = (1, 4, 16),
    cache_dir: str | None = "~/.cache/graphpipe/profiles",
    repeats: int = 3,
  ):
    self.analytic = analytic
    self.memory_bytes = analytic.memory_bytes
    self.name = f"profiled-{analytic.name}"
    self.fingerprint = graph_fingerprint(graph)
    self.batch_sizes = tuple(sorted(int(b) for b in batch_sizes))
    device = jax.devices()[0]
    self.device_kind = f"{device.platform}:{device.device_kind}"
    path = None
    if cache_dir is not None:
      slug = "".join(c if c.isalnum() else "_" for c in self.device_kind)
      name = f"{self.fingerprint}-{slug}-" + "_".join(
        map(str, self.batch_sizes)
      )
      path = os.path.join(os.path.expanduser(cache_dir), name + ".json")
    self.cache_path = path
    times = self._load(path)
    if times is None:
      times = self._profile(graph, repeats)
      self._store(path, times)
    self.times = times

  def _load(self, path):
    if path is None or not os.path.exists(path):
      return None
    with open(path) as f:
      data = json.load(f)
    if data.get("fingerprint") != self.fingerprint:
      return None
    return {int(k): v for k, v in data["times"].items()}

  def _store(self, path, times) -> None:
    if path is None:
      return
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
      json.dump(
        {
          "fingerprint": self.fingerprint,
          "device": self.device_kind,
          "batch_sizes": list(self.batch_sizes),
          "times": times,
        },
        f,
        indent=1,
      )

  def _profile(self, graph: OpGraph, repeats: int) -> dict:
    if graph.program is None:
      raise CostModelError(
        "profiling needs a captured graph (graph.program is None: it was "
        "loaded from JSON) and no cached profile was found: capture the "
        "model with graphpipe.capture, or use AnalyticCostModel"
      )
    times = {n.id: {"fwd": [], "bwd": []} for n in graph.nodes}
    for b in self.batch_sizes:
      program = graph.program.at_batch_size(b)
      for node_id, node_fn in enumerate(program.nodes):
        avals = node_fn.input_avals()
        args = _random_inputs(avals, node_id)
        forward, backward, differentiable = _fwd_bwd(node_fn, avals)
        fwd = _best_time(forward, *args, repeats=repeats)
        both = _best_time(backward, *args, repeats=repeats)
        times[node_id]["fwd"].append(fwd)
        times[node_id]["bwd"].append(max(both - fwd, 0.0) * differentiable)
    return times

  def node_time(self, node: Node, batch: float, kind: str) -> float:
    """Measured seconds of `node`'s pass at `batch` samples (interpolated)."""
    if kind not in ("fwd", "bwd"):
      raise CostModelError(f"kind must be 'fwd' or 'bwd', got {kind!r}")
    if node.id not in self.times:
      raise CostModelError(
        f"node {node.id} was not profiled: this profile is for graph "
        f"{self.fingerprint}; build the ProfiledCostModel for this graph"
      )
    return _interpolate(self.batch_sizes, self.times[node.id][kind], batch)

  def transfer_time(self, num_bytes: float, src: int, dst: int) -> float:
    """From the analytic model."""
    return self.analytic.transfer_time(num_bytes, src, dst)

  def allreduce_time(self, num_bytes: float, devices: Sequence[int]) -> float:
    """From the analytic model."""
    return self.analytic.allreduce_time(num_bytes, devices)

  def optimizer_time(self, param_bytes: float) -> float:
    """From the analytic model."""
    return self.analytic.optimizer_time(param_bytes)


class StageCosts:
  """Time and memory of candidate stages: what every planner minimises.

  A stage on k devices runs each micro-batch of b samples as k replicas of
  b / k samples (k must divide b). Per iteration of B samples (m = B / b
  micro-batches) it is busy for

    m * max(compute(b / k), transfers(b / k)) + all-reduce + optimizer

  where compute is the forward and backward of its nodes, transfers the
  busier direction of its boundary traffic (transfers overlap compute), the
  all-reduce that of its parameter bytes over its k devices, and the
  optimizer Adam's update. Divided by B that is the stage's time per sample;
  the bottleneck stage's bounds the pipeline's throughput. Memory follows
  `graphpipe.plan.stage_memory_bytes`, the rule the simulator also uses.

  Transfers are priced on the slowest link the plan may use (between nodes
  once it spans nodes) and all-reduces on devices 0..k-1, since device
  placement comes after partitioning.

  Example:
    >>> costs = StageCosts(graph, AnalyticCostModel(device_spec("v100")),
    ...                    batch_size=64, num_devices=8, memory_bytes=16e9)
    >>> costs.time_per_sample((0, 1), micro_batch=4, num_devices=2)
    >>> costs.in_flight_capacity((0, 1), micro_batch=4, num_devices=2)

  Args:
    graph: the operator graph.
    cost_model: any `graphpipe.plan.CostModel`.
    batch_size: samples per iteration.
    num_devices: devices the plan may use.
    memory_bytes: capacity of one device.
  """

  def __init__(
    self,
    graph: OpGraph,
    cost_model,
    batch_size: int,
    num_devices: int,
    memory_bytes: float,
  ):
    self.graph = graph
    self.cost_model = cost_model
    self.batch_size = batch_size
    self.num_devices = num_devices
    self.memory_bytes = float(memory_bytes)
    self._far_device = num_devices - 1
    self._times: dict[float, tuple[np.ndarray, np.ndarray]] = {}
    self._cache: dict[tuple, object] = {}
    self._params = np.array([n.param_bytes for n in graph.nodes], float)

  @staticmethod
  def share(micro_batch: int, num_devices: int) -> int | float:
    """Samples per device: micro_batch / num_devices (int when it divides)."""
    whole, rest = divmod(micro_batch, num_devices)
    return whole if not rest else micro_batch / num_devices

  def node_times(self, share: float) -> tuple[np.ndarray, np.ndarray]:
    """Forward and backward time of every node at `share` samples."""
    if share not in self._times:
      nodes = self.graph.nodes
      model = self.cost_model
      self._times[share] = (
        np.array([model.node_time(n, share, "fwd") for n in nodes]),
        np.array([model.node_time(n, share, "bwd") for n in nodes]),
      )
    return self._times[share]

  def compute_time(
    self, nodes: Sequence[int], micro_batch: int, num_devices: int
  ) -> tuple[float, float]:
    """(forward, backward) seconds of one micro-batch on each replica."""
    fwd, bwd = self.node_times(self.share(micro_batch, num_devices))
    index = list(nodes)
    return float(fwd[index].sum()), float(bwd[index].sum())

  def boundary_bytes(self, nodes: Sequence[int]) -> tuple[float, float]:
    """(bytes in, bytes out) per sample across the stage's boundary.

    A value read by several nodes of the stage travels once, so each
    outside producer counts with its largest edge (as in the simulator).
    """
    key = ("boundary", tuple(nodes))
    if key not in self._cache:
      inside = set(nodes)
      incoming: dict[int, float] = {}
      outgoing: dict[int, float] = {}
      for e in self.graph.edges:
        if (e.src in inside) == (e.dst in inside):
          continue
        side = outgoing if e.src in inside else incoming
        side[e.src] = max(side.get(e.src, 0.0), e.bytes)
      self._cache[key] = (sum(incoming.values()), sum(outgoing.values()))
    return self._cache[key]

  def transfer_time(self, num_bytes: float) -> float:
    """A point-to-point transfer on the slowest link the plan may use."""
    return self.cost_model.transfer_time(num_bytes, 0, self._far_device)

  def sync_time(self, nodes: Sequence[int], num_devices: int) -> float:
    """All-reduce (over k devices) plus optimizer step, once per iteration."""
    params = float(self._params[list(nodes)].sum())
    if params <= 0:
      return 0.0
    reduce = 0.0
    if num_devices > 1:
      reduce = self.cost_model.allreduce_time(params, range(num_devices))
    return reduce + self.cost_model.optimizer_time(params)

  def microbatch_time(
    self, nodes: Sequence[int], micro_batch: int, num_devices: int
  ) -> float:
    """Busy time per micro-batch: compute, or transfers if they are slower."""
    fwd, bwd = self.compute_time(nodes, micro_batch, num_devices)
    share = self.share(micro_batch, num_devices)
    incoming, outgoing = self.boundary_bytes(nodes)
    comm = self.transfer_time(max(incoming, outgoing) * share)
    return max(fwd + bwd, comm)

  def time_per_sample(
    self, nodes: Sequence[int], micro_batch: int, num_devices: int
  ) -> float:
    """The stage's busy time per iteration divided by the batch size."""
    key = ("tps", tuple(nodes), micro_batch, num_devices)
    if key not in self._cache:
      m = self.batch_size // micro_batch
      busy = m * self.microbatch_time(nodes, micro_batch, num_devices)
      busy += self.sync_time(nodes, num_devices)
      self._cache[key] = busy / self.batch_size
    return self._cache[key]

  def in_flight_capacity(
    self, nodes: Sequence[int], micro_batch: int, num_devices: int
  ) -> int:
    """Most in-flight micro-batches that fit memory (-1: not even weights)."""
    share = self.share(micro_batch, num_devices)
    key = ("cap", tuple(nodes), share)
    if key not in self._cache:
      nodes = list(nodes)
      static = stage_memory_bytes(self.graph, nodes, share, 0)
      per_flight = stage_memory_bytes(self.graph, nodes, share, 1) - static
      room = self.memory_bytes - static
      if room < 0:
        cap = -1
      elif per_flight <= 0 or math.isinf(room):
        cap = 1 << 30
      else:
        cap = int(room // per_flight)
        # Rounding must never let the planner exceed the shared rule.
        while cap > 0 and (
          stage_memory_bytes(self.graph, nodes, share, cap) > self.memory_bytes
        ):
          cap -= 1
      self._cache[key] = cap
    return self._cache[key]


def estimate_iteration_time(
  p: Plan, graph: OpGraph, cost_model: CostModel
) -> float:
  """Seconds per iteration of `p`, from the pipeline's critical path.

  steady state: once the first micro-batch reaches a stage, it runs its
    warm-up forwards (as many as it holds in flight) back to back, then
    one forward per period of the busiest stage (compute, or its busiest
    link);
  drain: it runs forward through the stage DAG to the sinks and backward
    to the sources (with the transfers on the way);
  end: each stage's all-reduce and optimizer step start after its own last
    backward; the iteration ends with the last of them.

  Example:
    >>> estimate_iteration_time(p, graph, AnalyticCostModel(spec))

  Args:
    p: the plan.
    graph: its operator graph.
    cost_model: the cost model to time it with.
  """
  n = p.num_stages
  share = [
    StageCosts.share(s.micro_batch_size, len(s.devices)) for s in p.stages
  ]
  fwd = [
    sum(
      cost_model.node_time(graph.nodes[i], share[s.id], "fwd") for i in s.nodes
    )
    for s in p.stages
  ]
  bwd = [
    sum(
      cost_model.node_time(graph.nodes[i], share[s.id], "bwd") for i in s.nodes
    )
    for s in p.stages
  ]
  owner = p.stage_of_node()
  # A value read by several nodes of a stage travels once (as simulated).
  largest: dict[tuple[int, int], dict[int, tuple[float, float]]] = {}
  for e in graph.edges:
    a, b = owner[e.src], owner[e.dst]
    if a != b:
      by_src = largest.setdefault((a, b), {})
      old = by_src.get(e.src, (0.0, 0.0))
      by_src[e.src] = (max(old[0], e.bytes), max(old[1], e.fixed_bytes))
  transfer = {}
  for a, b in p.stage_edges:
    src, dst = p.stages[a], p.stages[b]
    pairs = max(len(src.devices), len(dst.devices))
    values = largest.get((a, b), {}).values()
    total = sum(x * src.micro_batch_size + fixed for x, fixed in values)
    transfer[(a, b)] = cost_model.transfer_time(
      total / pairs, src.devices[0], dst.devices[0]
    )
  busy = [fwd[s] + bwd[s] for s in range(n)]
  for (a, b), t in transfer.items():
    busy[a] = max(busy[a], t)
    busy[b] = max(busy[b], t)
  # Follow the last micro-batch forward to the sinks and backward to the
  # sources; each stage then all-reduces and steps.
  m, period = p.num_microbatches, max(busy)
  first_end = [0.0] * n
  forward_end = [0.0] * n
  for s in range(n):
    arrival = max(
      (first_end[a] + transfer[(a, s)] for a in p.predecessors(s)),
      default=0.0,
    )
    first_end[s] = arrival + fwd[s]
    # After the first micro-batch arrives, stage s runs its warm-up forwards
    # (as many as it holds in flight) back to back, then one forward per
    # period of the busiest stage.
    warm = min(m, p.stages[s].in_flight)
    start = arrival + (warm - 1) * fwd[s] + (m - warm) * period
    forward_end[s] = fwd[s] + max(
      [start] + [forward_end[a] + transfer[(a, s)] for a in p.predecessors(s)]
    )
  # GPipe runs every backward after every forward.
  backlog = (m - 1) * max(bwd) if p.schedule == "gpipe" else 0.0
  end = 0.0
  backward_end = [0.0] * n
  for s in reversed(range(n)):
    backward_end[s] = bwd[s] + max(
      (backward_end[t] + transfer[(s, t)] for t in p.successors(s)),
      default=forward_end[s] + backlog,
    )
    params = sum(graph.nodes[i].param_bytes for i in p.stages[s].nodes)
    sync = 0.0
    if params > 0:
      sync = cost_model.optimizer_time(params)
      if len(p.stages[s].devices) > 1:
        sync += cost_model.allreduce_time(params, p.stages[s].devices)
    end = max(end, backward_end[s] + sync)
  return end
