"""Bytes that the collectives of a compiled XLA program move between devices.

`collective_bytes(hlo_text)` reads the text of a compiled HLO module
(`jax.jit(f).lower(...).compile().as_text()`), finds every collective
instruction and sums what it sends, over all devices, for one run of the
program. Operand shapes are looked up by name, so asynchronous forms
(`collective-permute-start`) count like synchronous ones and their `-done`
halves count nothing. What a collective sends, per replica group of g
devices whose operands each hold S bytes:

- collective-permute: S for each source-target pair.
- all-gather: each member sends its operand to the g - 1 others,
  g (g - 1) S.
- all-to-all: each member keeps 1/g of its operand and sends the rest,
  (g - 1) S.
- reduce-scatter: the ring algorithm, each member sends (g - 1) / g of its
  operand, (g - 1) S.
- all-reduce: the ring algorithm (a reduce-scatter then an all-gather),
  2 (g - 1) S.

A collective inside a called computation (a loop body or a branch) would
run an unknown number of times, so it is refused rather than guessed.
"""

import dataclasses
import math
import re

from disco.errors import HloError

KINDS = (
  "collective-permute",
  "all-gather",
  "all-to-all",
  "reduce-scatter",
  "all-reduce",
)

_ITEMSIZE = {
  "pred": 1,
  "s8": 1,
  "u8": 1,
  "s16": 2,
  "u16": 2,
  "f16": 2,
  "bf16": 2,
  "s32": 4,
  "u32": 4,
  "f32": 4,
  "s64": 8,
  "u64": 8,
  "f64": 8,
  "c64": 8,
  "c128": 16,
}
_INSTRUCTION = re.compile(
  r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+([a-z][\w\-]*)\((.*)$"
)
_ARRAY = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")
_OPERAND = re.compile(r"%([\w.\-]+)")
_PAIRS = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")
_LISTED_GROUPS = re.compile(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}")
_IOTA_GROUPS = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=")
_PARTITIONS = re.compile(r"num_partitions=(\d+)")
_REPLICAS = re.compile(r"replica_count=(\d+)")


@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective instruction and the bytes it sends in one run.

  Example:
    >>> Collective("ppermute.1", "collective-permute", 48, 2, 96).bytes_sent
    96

  Args:
    name: the instruction's name in the HLO module.
    kind: one of `KINDS`.
    operand_bytes: bytes of its operands on one device.
    peers: source-target pairs (permute) or devices per replica group.
    bytes_sent: bytes it sends over all devices.
  """

  name: str
  kind: str
  operand_bytes: int
  peers: int
  bytes_sent: int


def collective_bytes(hlo_text: str) -> tuple[Collective, ...]:
  """Every collective of a compiled HLO module with the bytes it sends.

  Example:
    >>> import jax, numpy as np
    >>> from jax.sharding import Mesh, PartitionSpec as P
    >>> mesh = Mesh(np.array(jax.devices()[:2]), ("node",))
    >>> swap = jax.shard_map(
    ...   lambda x: jax.lax.ppermute(x, "node", [(0, 1), (1, 0)]),
    ...   mesh=mesh, in_specs=P("node"), out_specs=P("node"))
    >>> text = jax.jit(swap).lower(np.ones((2, 3), np.float32)).compile()
    >>> [c.bytes_sent for c in collective_bytes(text.as_text())]
    [24]

  Args:
    hlo_text: the text of a compiled (or optimised) HLO module.

  Raises:
    HloError: a collective whose operands or groups cannot be read, or one
      inside a called computation.
  """
  devices = _device_count(hlo_text)
  shapes = {}
  found = []
  computation = None
  for line in hlo_text.splitlines():
    if line.startswith("ENTRY"):
      computation = "ENTRY"
      continue
    if line.startswith("%") and line.rstrip().endswith("{"):
      computation = line.split()[0]
      continue
    match = _INSTRUCTION.match(line)
    if match is None:
      continue
    name, result_type, opcode, rest = match.groups()
    shapes[name] = result_type
    kind = opcode.removesuffix("-start")
    if kind in KINDS:
      if computation != "ENTRY":
        raise HloError(
          f"{opcode} {name} is inside {computation}, which may run any "
          "number of times; only straight-line programs can be counted"
        )
      found.append((name, kind, rest))
  return tuple(_collective(n, k, r, shapes, devices) for n, k, r in found)


def total_bytes(hlo_text: str) -> int:
  """Bytes all collectives of a compiled HLO module send in one run.

  Example:
    >>> total_bytes("HloModule empty\\nENTRY %main () -> f32[] {\\n}")
    0

  Args:
    hlo_text: the text of a compiled HLO module.
  """
  return sum(c.bytes_sent for c in collective_bytes(hlo_text))


def _collective(name, kind, rest, shapes, devices) -> Collective:
  operands_text = rest.split(")", 1)[0]
  operands = _OPERAND.findall(operands_text)
  if not operands or any(o not in shapes for o in operands):
    raise HloError(f"{kind} {name}: cannot find the shapes of its operands")
  operand_bytes = sum(_nbytes(shapes[o], name) for o in operands)
  if kind == "collective-permute":
    pairs = _PAIRS.search(rest)
    if pairs is None:
      raise HloError(f"{name}: no source_target_pairs")
    peers = pairs.group(1).count("{")
    return Collective(name, kind, operand_bytes, peers, peers * operand_bytes)
  groups, size = _groups(rest, devices, name)
  factor = {
    "all-gather": size * (size - 1),
    "all-to-all": size - 1,
    "reduce-scatter": size - 1,
    "all-reduce": 2 * (size - 1),
  }[kind]
  return Collective(
    name, kind, operand_bytes, size, groups * factor * operand_bytes
  )


def _groups(rest: str, devices: int, name: str) -> tuple[int, int]:
  """(number of replica groups, devices per group)."""
  iota = _IOTA_GROUPS.search(rest)
  if iota is not None:
    return int(iota.group(1)), int(iota.group(2))
  listed = _LISTED_GROUPS.search(rest)
  if listed is None:
    raise HloError(f"{name}: cannot read its replica_groups")
  groups = re.findall(r"\{([\d,]*)\}", listed.group(1))
  if not groups:  # no groups listed: one group of every device
    return 1, devices
  sizes = {len(g.split(",")) for g in groups}
  if len(sizes) != 1:
    raise HloError(f"{name}: replica groups of different sizes {sizes}")
  return len(groups), sizes.pop()


def _nbytes(result_type: str, name: str) -> int:
  arrays = _ARRAY.findall(result_type)
  if not arrays:
    raise HloError(f"{name}: cannot read the operand type {result_type!r}")
  total = 0
  for dtype, dims in arrays:
    if dtype not in _ITEMSIZE:
      raise HloError(f"{name}: unknown element type {dtype}")
    shape = [int(d) for d in dims.split(",") if d]
    total += _ITEMSIZE[dtype] * math.prod(shape)
  return total


def _device_count(hlo_text: str) -> int:
  header = hlo_text.split("\n", 1)[0]
  partitions = _PARTITIONS.search(header)
  replicas = _REPLICAS.search(header)
  return (int(partitions.group(1)) if partitions else 1) * (
    int(replicas.group(1)) if replicas else 1
  )
