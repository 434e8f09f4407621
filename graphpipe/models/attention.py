"""Scaled dot-product attention, shared by graphpipe's zoo and disco.

Written with einsums rather than `jax.nn.dot_product_attention` so that the
traced jaxpr holds plain matmuls and a softmax that any backend can run and
any cost model can count. jnp only, so that it imports no layer library.
"""

import jax
import jax.numpy as jnp


def dot_product_attention(
  query: jax.Array, key: jax.Array, value: jax.Array
) -> jax.Array:
  """softmax(query . key / sqrt(head_dim)) . value, head by head.

  Example:
    >>> import jax.numpy as jnp
    >>> x = jnp.ones((2, 5, 4, 8))  # batch, sequence, heads, head_dim
    >>> dot_product_attention(x, x, x).shape
    (2, 5, 4, 8)

  Args:
    query: [..., query_seq, heads, head_dim].
    key: [..., key_seq, heads, head_dim].
    value: [..., key_seq, heads, value_dim].

  Returns:
    [..., query_seq, heads, value_dim]: for every query, the values averaged
    with the softmax over keys of the scaled query-key products.
  """
  head_dim = query.shape[-1]
  logits = jnp.einsum("...qhd,...khd->...hqk", query, key) / jnp.sqrt(head_dim)
  weights = jax.nn.softmax(logits, axis=-1)
  return jnp.einsum("...hqk,...khd->...qhd", weights, value)
