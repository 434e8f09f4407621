"""The analytic cost model: device specs, presets and roofline node times.

  model = AnalyticCostModel(device_spec("v100"))
  model.node_time(node, batch=4, kind="fwd")

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
import os
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from graphpipe.core.graph import Node
from graphpipe.errors import CostModelError

# Elements per streaming multiprocessor at which a kernel reaches half its
# peak efficiency (calibrated on the paper's case study, module docstring).
_HALF_EFFICIENCY_ELEMENTS_PER_SM = 1440
# Adam's update reads parameters, gradients and two moments and writes the
# parameters and the moments: 7 passes over the parameter bytes.
_ADAM_PASSES = 7
# The runtime adds each micro-batch's gradient to its accumulated slots:
# the stage's branch writes the gradient out as a slot-sized array, then
# an add reads it and the accumulator and writes the accumulator back.
_GRADIENT_ADD_PASSES = 4
# Kernels never run slower than this share of max efficiency (reductions
# and losses have tiny outputs but spread their inputs over the device).
_MIN_EFFICIENCY_SHARE = 0.02
_BYTES_PER_ELEMENT = 4


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
  """One accelerator and its links, as the analytic cost model sees it.

  Example:
    >>> spec = device_spec("v100")
    >>> spec.peak_flops["float32"] / 1e12, spec.devices_per_node
    (15.7, 4)
    >>> v100_32gb = dataclasses.replace(spec, memory_bytes=32 * 2**30)
    >>> v100_32gb.memory_bytes / 2**30
    32.0

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
  h100 = DeviceSpec(
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
  )
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
    "h100": h100,
    # The H100's compute and links, with more and faster memory.
    "h200": dataclasses.replace(
      h100,
      name="h200",
      memory_bandwidth=4800e9,
      memory_bytes=143771 * 2**20,
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
  if not isinstance(name, str):
    raise CostModelError(
      f"device_spec takes a preset name ({', '.join(PRESETS)}), got a "
      f"{type(name).__name__}"
    )
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


def spec_of(device: str | DeviceSpec) -> DeviceSpec:
  """`device` itself if it is a `DeviceSpec`, else the preset it names.

  Example:
    >>> spec_of("v100") == spec_of(device_spec("v100"))
    True
  """
  return device if isinstance(device, DeviceSpec) else device_spec(device)


def best_time(fn: Callable, *args, repeats: int = 5) -> float:
  """The fastest of `repeats` timed calls of jitted `fn` (after a warm-up).

  Example:
    >>> a = jnp.ones((128, 128))
    >>> seconds = best_time(jax.jit(jnp.matmul), a, a)
    >>> 0 < seconds < 1
    True

  Args:
    fn: a jitted function.
    *args: its arguments.
    repeats: timed calls after the warm-up call.
  """
  jax.block_until_ready(fn(*args))
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    best = min(best, time.perf_counter() - start)
  return best


def best_time_in_place(fn: Callable, first, *rest, repeats: int = 5) -> float:
  """The fastest of `repeats` timed calls of `fn(first, *rest)`, each
  writing over `first`: `fn` is jitted with its first argument donated
  and each call takes the previous result (`first` itself is consumed).
  What updates of donated buffers cost, without the system mapping fresh
  pages for a new result (`best_time` pays that on large outputs)."""
  step = jax.jit(fn, donate_argnums=0)
  out = step(first, *rest)
  jax.block_until_ready(out)
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    out = step(out, *rest)
    jax.block_until_ready(out)
    best = min(best, time.perf_counter() - start)
  return best


# Measured once per process: the machine does not change while it runs, and
# every `device_spec('cpu')` call must agree with the previous ones.
@functools.cache
def measure_cpu() -> DeviceSpec:
  """A `DeviceSpec` for this machine's CPU devices, from a short benchmark.

  Times float32 matmuls of 128 and 512 squared (their ratio gives the
  half-efficiency size of the curve, the large one the peak) and a 32 MiB
  elementwise pass twice: in place (the memory bandwidth: what an update of
  donated buffers streams, as the runtime's optimizer step and gradient
  sums do) and into a new array (transfers: a copy into fresh memory,
  whose pages the system maps as it is written: on this project's machine
  2 GB/s where the pass in place streams 20, measured 2026-12-07). The
  simulated JAX devices share the host's memory, so each gets an equal
  share of it; transfers between them are such copies.

  Example:
    >>> spec = measure_cpu()
    >>> spec.peak_flops["float32"] > 1e9
    True
  """
  matmul = jax.jit(jnp.matmul)
  rates = {}
  for n in (128, 512):
    a = jnp.ones((n, n), jnp.float32)
    rates[n] = 2 * n**3 / best_time(matmul, a, a)
  small, large = 128.0**2, 512.0**2
  slowdown = max(rates[512] / rates[128], 1.0)
  # Solve efficiency(small) / efficiency(large) = 1 / slowdown for the
  # half-efficiency size h of the curve E / (E + h).
  denom = 1.0 / small - slowdown / large
  half = max((slowdown - 1.0) / denom, 0.0) if denom > 0 else large
  peak = rates[512] * (large + half) / large
  x = jnp.ones((8 * 2**20,), jnp.float32)
  copy_bw = 2 * x.nbytes / best_time(jax.jit(lambda v: v + 1.0), x)
  stream_bw = 2 * x.nbytes / best_time_in_place(lambda v: v + 1.0, x)
  host_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  num_devices = max(jax.local_device_count("cpu"), 1)
  return DeviceSpec(
    name="cpu",
    peak_flops={"float32": peak, "bfloat16": peak, "float16": peak},
    memory_bandwidth=stream_bw,
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
      f"{rates[128] / 1e9:.3g} at 128^2, {stream_bw / 1e9:.3g} GB/s in "
      f"place, a copy into new memory {copy_bw / 1e9:.3g} GB/s, "
      f"{num_devices} JAX CPU devices sharing {host_bytes / 2**30:.3g} GiB"
    ),
  )


class AnalyticCostModel:
  """Roofline node times and affine communication for a `DeviceSpec`.

  See the module docstring for the efficiency curve and its calibration.

  Example:
    >>> model = AnalyticCostModel(device_spec("v100"))
    >>> layer = Node(0, "ffn", fwd_flops=1e9, activation_bytes=4e6)
    >>> model.node_time(layer, batch=4, kind="fwd")   # 4 GFLOP, seconds
    0.000327...
    >>> model.transfer_time(2**20, src=0, dst=5)   # crosses nodes: 12.5 GB/s
    9.388608e-05
    >>> model.allreduce_time(256e6, devices=range(8))
    0.03598...

  Args:
    spec: the device and its links.
    dtype: compute dtype, a key of `spec.peak_flops`.
  """

  def __init__(self, spec: DeviceSpec, dtype: str = "float32"):
    if not isinstance(spec, DeviceSpec):
      raise CostModelError(
        f"AnalyticCostModel takes a DeviceSpec (e.g. device_spec('v100')), "
        f"got a {type(spec).__name__}"
      )
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
      >>> model = AnalyticCostModel(device_spec("v100"))
      >>> model.allreduce_time(1e9, [0, 1, 2, 3])  # 1.5 GB over NVLink
      0.03003
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

  def gradient_add_time(self, num_bytes: float) -> float:
    """One micro-batch's gradient added to accumulated slots of
    `num_bytes`, as `graphpipe.runtime` does at every backward: 4 memory
    passes (the gradient written out at the slots' size, then it and the
    accumulator read and the sum written)."""
    return _GRADIENT_ADD_PASSES * num_bytes / self._bandwidth
