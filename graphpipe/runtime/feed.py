"""The step's batch: packed per device on the host, read back in the step.

  words = pack(feed, batch, num_words)   # host: numpy uint32 [num_words]
  rows = read(feed, vector, microbatch)  # in the step: {'batch:x': chunk}

The layout of a device's words is `graphpipe.core.feed`'s: per leaf its
stage reads, one piece per micro-batch, each piece the device's rows of
that micro-batch as little-endian bytes padded to a word. Leaves of any
dtype share one vector: 4-byte dtypes are bit-cast from the words, other
sizes through bytes (booleans are bytes compared with zero).

Example:
  >>> from graphpipe.core.feed import device_feeds
  >>> from graphpipe.core.graph import InputSpec
  >>> feeds = device_feeds([InputSpec("x", (2,), "float32")],
  ...                      [(("x",), (0, 1), 2)], num_devices=2, batch_size=4)
  >>> batch = {"x": np.arange(8, dtype=np.float32).reshape(4, 2)}
  >>> words = pack(feeds[1], batch, 4)         # replica 1: rows 1 and 3
  >>> read(feeds[1], jnp.asarray(words), 1)["batch:x"]
  Array([[6., 7.]], dtype=float32)
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from graphpipe.core.feed import DeviceFeed, itemsize
from graphpipe.core.graph import InputSpec
from graphpipe.errors import PipelineRuntimeError


class FedBatch(NamedTuple):
  """A batch as the step takes it (`Trainer.put_batch`): per device, a row
  of 32-bit words holding its own rows of its stage's leaves, and the
  batch's data statistics the loss reads (the same on every device)."""

  words: jax.Array
  feeds: tuple  # the `DeviceFeed`s it was packed for
  statistics: dict = {}  # 'global:k' -> a replicated array


def put(
  batch,
  inputs: Sequence[InputSpec],
  batch_size: int,
  feeds: Sequence[DeviceFeed],
  num_words: int,
  sharding,
  packer=None,
  statistics=None,
) -> FedBatch:
  """Checks `batch` against the graph's leaves and packs every device's
  row of a [devices, num_words] array with `sharding` (one row a device);
  each process packs only its own devices' rows. Leaves already on the
  mesh's devices (any sharding) are packed there by `packer`
  (`device_packer`). `statistics(leaves, on_mesh)` computes the batch's
  data statistics from the leaves by name."""
  if isinstance(batch, FedBatch):
    if (
      batch.feeds != tuple(feeds)
      or batch.words.shape[1] != num_words
      # A batch put on another mesh failed inside jit (incompatible devices).
      or batch.words.sharding.device_set != set(sharding.mesh.devices.flat)
    ):
      raise PipelineRuntimeError(
        "this batch was put for another step's devices and stages: put "
        "it with this trainer's put_batch"
      )
    return batch
  specs = {i.name: i for i in inputs}
  leaves = jax.tree_util.tree_flatten_with_path(batch)[0]
  names = [".".join(_key(k) for k in path) for path, _ in leaves]
  if sorted(names) != sorted(specs):
    raise PipelineRuntimeError(
      f"the batch has leaves {sorted(names)}, the graph expects {sorted(specs)}"
    )
  host = {}
  for name, (_, x) in zip(names, leaves, strict=True):
    spec = specs[name]
    want = (batch_size,) + tuple(spec.shape)
    if (
      isinstance(x, np.ndarray)
      and str(x.dtype) != spec.dtype
      and str(jax.dtypes.canonicalize_dtype(x.dtype)) == spec.dtype
    ):
      # As JAX takes it (and `capture` did): int64 / float64 numpy values
      # as int32 / float32 without 64-bit mode.
      x = x.astype(spec.dtype)
    if tuple(x.shape) != want or str(x.dtype) != spec.dtype:
      raise PipelineRuntimeError(
        f"batch leaf {name!r} is {x.dtype}{list(x.shape)}; the plan "
        f"needs {spec.dtype}{list(want)}"
      )
    host[name] = x
  if packer is not None and all(_on(x, sharding) for x in host.values()):
    # Already on the trainer's devices (replicated, or sharded any way,
    # across processes too): packed there, each device its own row. A
    # leaf laid out over them in another order is moved onto the
    # trainer's mesh first (jit refuses devices in another order).
    host = {name: _in_mesh_order(x, sharding) for name, x in host.items()}
    stats = statistics(host, True) if statistics else {}
    return FedBatch(packer(host), tuple(feeds), stats)
  host = {name: _host(x, name) for name, x in host.items()}

  def rows(index):
    devices = range(len(feeds))[index[0]]
    return np.stack([pack(feeds[d], host, num_words) for d in devices])

  return FedBatch(
    jax.make_array_from_callback((len(feeds), num_words), sharding, rows),
    tuple(feeds),
    statistics(host, False) if statistics else {},
  )


def statistics_of(program, replicated):
  """f(leaves by name, on_mesh) -> the loss's data statistics of a whole
  batch (a token count, a feature's largest value: the 'global:k' values
  of `program.prepass`, `graphpipe.frontend.loss_form`) on every device of
  `replicated`'s mesh; computed where the leaves are (on the mesh, or on
  this process's first device from the host batch). None where the loss
  reads none."""
  prepass = program.prepass
  if not prepass.outputs:
    return None
  names = sorted(
    k[len("batch:") :] for k in prepass.inputs if k.startswith("batch:")
  )

  def compute(leaves):
    env = {**program.consts, **{f"batch:{n}": leaves[n] for n in names}}
    outs = prepass(*[env[k] for k in prepass.inputs])
    return dict(zip(prepass.outputs, outs, strict=True))

  on_mesh = jax.jit(compute, out_shardings=replicated)
  on_host = jax.jit(compute)

  def statistics(leaves, mesh: bool) -> dict:
    leaves = {n: leaves[n] for n in names}
    if mesh:
      return on_mesh(leaves)
    return {
      k: _replicate(np.asarray(v), replicated)
      for k, v in on_host(leaves).items()
    }

  return statistics


def with_streams(fed: FedBatch, program, rng, replicated) -> FedBatch:
  """`fed` with the keys of the random streams the model draws from
  (`program.streams`) for the step's key `rng` (their data, replicated:
  `graphpipe.frontend.streams`)."""
  streams = program.streams
  if not streams:
    if rng is not None:
      raise PipelineRuntimeError(
        "rng= is for models that draw random numbers in training; this "
        "one draws none (an NNX model's streams are its nnx.Rngs, a linen "
        "module's are named at capture: rngs=('dropout',))"
      )
    return fed
  if rng is None:
    if all(k in fed.statistics for k in streams):
      return fed  # put with its keys before
    raise PipelineRuntimeError(
      f"this model draws random numbers in training (streams "
      f"{[k[len('rng:') :] for k in streams]}): pass the step's key, "
      "trainer.step(state, batch, rng=jax.random.key(step))"
    )
  keys = program.stream_keys(rng)
  data = {
    k: _replicate(np.asarray(jax.random.key_data(keys[k])), replicated)
    for k in streams
  }
  return fed._replace(statistics={**fed.statistics, **data})


def _replicate(value: np.ndarray, replicated) -> jax.Array:
  """A host value on every device of `replicated`'s mesh."""
  return jax.make_array_from_callback(value.shape, replicated, lambda _: value)


def device_packer(feeds: Sequence[DeviceFeed], num_words: int, sharding):
  """A jitted function from leaves on `sharding`'s devices (by name) to
  the [devices, num_words] words, each device packing its row. A leaf
  that is not replicated is gathered onto every device first (for the
  packing only: the step holds just the words)."""
  axis = sharding.spec[0]
  everywhere = jax.sharding.NamedSharding(
    sharding.mesh, jax.sharding.PartitionSpec()
  )

  def row(feed, batch):
    parts = [jnp.zeros((0,), jnp.uint32)]
    for block in feed.blocks:
      start = feed.replica * feed.chunk
      rows = batch[block.name].reshape(feed.microbatches, feed.size, -1)
      rows = rows[:, start : start + feed.chunk].reshape(feed.microbatches, -1)
      parts.append(_encode(rows, block).reshape(-1))
    words = jnp.concatenate(parts)
    return jnp.pad(words, (0, num_words - words.shape[0]))

  def body(batch):
    branches = [functools.partial(row, f) for f in feeds]
    return lax.switch(lax.axis_index(axis), branches, batch)[None]

  packed = jax.shard_map(
    body,
    mesh=sharding.mesh,
    in_specs=jax.sharding.PartitionSpec(),
    out_specs=sharding.spec,
    check_vma=False,
  )
  return jax.jit(
    lambda batch: packed(lax.with_sharding_constraint(batch, everywhere))
  )


def _encode(rows, block):
  """[pieces, elements] of one leaf -> [pieces, block.words] words."""
  size = itemsize(block.dtype)
  if size == 4:
    return lax.bitcast_convert_type(rows, jnp.uint32)
  if rows.dtype == jnp.bool_:
    raw = rows.astype(jnp.uint8)
  else:
    raw = lax.bitcast_convert_type(rows, jnp.uint8)
  raw = raw.reshape(rows.shape[0], -1)
  raw = jnp.pad(raw, ((0, 0), (0, 4 * block.words - raw.shape[1])))
  return lax.bitcast_convert_type(
    raw.reshape(rows.shape[0], block.words, 4), jnp.uint32
  )


def _on(x, sharding) -> bool:
  return isinstance(x, jax.Array) and x.sharding.device_set == (
    sharding.device_set
  )


def _in_mesh_order(x, sharding):
  """`x`, replicated on `sharding`'s mesh unless its devices already come
  in that mesh's order."""
  order = tuple(sharding.mesh.devices.flat)
  mesh = getattr(x.sharding, "mesh", None)
  if mesh is not None and tuple(mesh.devices.flat) == order:
    return x
  everywhere = jax.sharding.NamedSharding(
    sharding.mesh, jax.sharding.PartitionSpec()
  )
  return jax.device_put(x, everywhere)


def _host(x, name: str) -> np.ndarray:
  """A batch leaf on the host (a device array is copied from a device)."""
  if not isinstance(x, jax.Array) or x.is_fully_addressable:
    return np.asarray(x)
  if x.is_fully_replicated:
    return np.asarray(x.addressable_data(0))
  raise PipelineRuntimeError(
    f"batch leaf {name!r} is a jax.Array sharded across processes but "
    "not on the trainer's devices (or beside leaves that are not): put "
    "every leaf on the trainer's devices, or give every process the "
    "whole batch"
  )


def _key(k) -> str:
  for attr in ("key", "idx", "name"):
    if hasattr(k, attr):
      return str(getattr(k, attr))
  return str(k)


def pack(feed: DeviceFeed, batch: dict, num_words: int) -> np.ndarray:
  """A device's words from the host batch (leaves by name, numpy)."""
  out = np.zeros(num_words, np.uint32)
  view = out.view(np.uint8)
  pieces = feed.microbatches
  for block in feed.blocks:
    leaf = np.ascontiguousarray(batch[block.name])
    whole = leaf.view(np.uint8).reshape(-1)
    if feed.chunk == feed.size and whole.size == 4 * block.words * pieces:
      # One replica, no padding: the pieces are the leaf as it is.
      view[4 * block.offset : 4 * block.offset + whole.size] = whole
      continue
    for j in range(pieces):
      start, stop = feed.rows(j)
      data = leaf[start:stop].view(np.uint8).reshape(-1)
      at = 4 * (block.offset + j * block.words)
      view[at : at + data.size] = data
  return out


def read(feed: DeviceFeed, vector, microbatch) -> dict:
  """{'batch:name': [chunk, *shape]} of piece `microbatch` (traced)."""
  out = {}
  for block in feed.blocks:
    words = lax.dynamic_slice_in_dim(
      vector, block.offset + microbatch * block.words, block.words
    )
    out["batch:" + block.name] = _decode(words, block, feed.chunk)
  return out


def _decode(words, block, chunk: int):
  shape = (chunk, *block.shape)
  count = int(np.prod(shape))
  size = itemsize(block.dtype)
  dtype = jnp.dtype(block.dtype)
  if size == 4:
    return lax.bitcast_convert_type(words[:count], dtype).reshape(shape)
  raw = lax.bitcast_convert_type(words, jnp.uint8).reshape(-1)
  raw = raw[: count * size]
  if dtype == jnp.bool_:
    return (raw != 0).reshape(shape)
  if size == 1:
    return lax.bitcast_convert_type(raw, dtype).reshape(shape)
  return lax.bitcast_convert_type(raw.reshape(count, size), dtype).reshape(
    shape
  )
