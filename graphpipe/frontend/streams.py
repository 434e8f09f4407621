"""Random streams in training: draws that do not depend on the plan.

A model that draws in training (dropout, a VAE's noise, an RNN cell's
rng) reads its streams' keys: an NNX model its `RngKey` variables
(`nnx.Rngs(dropout=...)`), a linen module the `rngs` capture is told
about. Under micro-batching each chunk runs the model's code on its own
samples, and a mask drawn in the chunk's shape from the same key is not
the chunk's rows of the whole batch's mask. graphpipe's streams follow one
rule instead, the same at any micro-batch size, data-parallel split or
plan:

  the leading axis of a draw holds samples, and sample j of the batch
  draws its part from fold_in(key, j)

A key of the `per_sample` implementation carries, beside its two words of
threefry state, the index of the first sample of the chunk it serves; its
`random_bits` folds each leading index into the key (a whole batch is the
chunk starting at 0). `split` and `fold_in` act on the state and keep the
index, so the keys the model derives (each dropout layer its own) keep
the rule. The step's key gives stream k the key
`per_sample_key(fold_in(step_key, k))`.

Example:
  >>> key = per_sample_key(jax.random.key(0))
  >>> whole = jax.random.bernoulli(key, 0.5, (8, 3))
  >>> part = jax.random.bernoulli(at_sample(key, 4), 0.5, (4, 3))
  >>> bool((whole[4:] == part).all())    # samples 4-7, drawn alone
  True
"""

from __future__ import annotations

import jax
import jax.extend.random as jex_random
import jax.numpy as jnp

_THREEFRY = jex_random.threefry_prng_impl


def _seed(seed):
  return jnp.concatenate([_THREEFRY.seed(seed), jnp.zeros((1,), jnp.uint32)])


def _split(key, shape):
  keys = _THREEFRY.split(key[:2], shape)
  first = jnp.broadcast_to(key[2], (*shape, 1)).astype(jnp.uint32)
  return jnp.concatenate([keys, first], axis=-1)


def _fold_in(key, data):
  return jnp.concatenate([_THREEFRY.fold_in(key[:2], data), key[2:]])


def _random_bits(key, bit_width, shape):
  if not shape:
    return _THREEFRY.random_bits(key[:2], bit_width, shape)
  samples = key[2] + jnp.arange(shape[0], dtype=jnp.uint32)
  keys = jax.vmap(lambda j: _THREEFRY.fold_in(key[:2], j))(samples)
  return jax.vmap(
    lambda k: _THREEFRY.random_bits(k, bit_width, tuple(shape[1:]))
  )(keys)


PER_SAMPLE = jex_random.define_prng_impl(
  key_shape=(3,),
  seed=_seed,
  split=_split,
  random_bits=_random_bits,
  fold_in=_fold_in,
  name="graphpipe_per_sample",
  tag="ps",
)
# (Abstract: a concrete key would start JAX's backend at import, before a
# multi-process run may call jax.distributed.initialize.)
DTYPE = jax.eval_shape(lambda: jax.random.key(0, impl=PER_SAMPLE)).dtype


def is_per_sample(key) -> bool:
  return getattr(key, "dtype", None) == DTYPE


def per_sample_key(key) -> jax.Array:
  """A key of the per-sample rule (module docstring) from a JAX key (typed
  or raw uint32[2]) or an int seed, serving a batch from sample 0."""
  if isinstance(key, int):
    key = jax.random.key(key)
  if is_per_sample(key):
    return key
  if jax.dtypes.issubdtype(jnp.asarray(key).dtype, jax.dtypes.prng_key):
    key = jax.random.key_data(key)
  data = jnp.asarray(key, jnp.uint32).reshape(-1)[-2:]
  return jax.random.wrap_key_data(
    jnp.concatenate([data, jnp.zeros((1,), jnp.uint32)]), impl=PER_SAMPLE
  )


def at_sample(key, first) -> jax.Array:
  """`key` serving the chunk whose first sample is `first` of the batch."""
  data = jax.random.key_data(key)
  data = data.at[..., 2].set(jnp.asarray(first, jnp.uint32))
  return jax.random.wrap_key_data(data, impl=PER_SAMPLE)


def stream_keys(step_key, count: int) -> list[jax.Array]:
  """The keys of a model's `count` streams for one step."""
  if isinstance(step_key, int):
    step_key = jax.random.key(step_key)
  return [per_sample_key(jax.random.fold_in(step_key, k)) for k in range(count)]
