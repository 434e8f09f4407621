"""Child of test_two_processes_equal_one_process: one process per node.

Started by `graphpipe.runtime.launch.launch` with one CPU device per
process; prints the logits node 0 computed and the bytes the compiled
program sends. `case()` is the model and images both runs use.
"""

import json

import numpy as np


def with_random_batch_norm(model, seed: int):
  """Gives every batch norm non-trivial statistics, so folding is tested."""
  from flax import nnx

  rng = np.random.default_rng(seed)
  for _, module in nnx.iter_modules(model):
    if isinstance(module, nnx.BatchNorm):
      size = module.mean.shape[0]
      module.mean[...] = rng.normal(0.0, 0.2, size).astype(np.float32)
      module.var[...] = rng.uniform(0.5, 2.0, size).astype(np.float32)
      module.scale[...] = rng.uniform(0.5, 1.5, size).astype(np.float32)
      module.bias[...] = rng.normal(0.0, 0.2, size).astype(np.float32)
  return model


def with_random_vit_weights(model, seed: int):
  """Random LayerNorm scales and biases, class token and positions.

  Their defaults (ones, zeros, zeros, near-zero) are the same on every
  node, so a node reading another node's slice of them would go unseen.
  """
  from flax import nnx

  from disco.transformer import DiscoLayerNorm

  rng = np.random.default_rng(seed)
  for _, module in nnx.iter_modules(model):
    if isinstance(module, DiscoLayerNorm):
      size = module.scale.shape[0]
      module.scale[...] = rng.uniform(0.5, 1.5, size).astype(np.float32)
      module.bias[...] = rng.normal(0.0, 0.5, size).astype(np.float32)
  for variable in (model.cls_token, model.pos_embed):
    shape = variable[...].shape
    variable[...] = rng.normal(0.0, 0.5, shape).astype(np.float32)
  return model


def case():
  """A 2-node ResNet at r = 0.3 and two images, the same in every process."""
  from flax import nnx

  from disco import prune
  from disco.models import ResNet, ResNetConfig

  model = ResNet(ResNetConfig(num_nodes=2), rngs=nnx.Rngs(3))
  with_random_batch_norm(model, 4)
  prune.to_ratio(model, 0.3)
  model.eval()
  images = np.random.default_rng(5).standard_normal((2, 16, 16, 1))
  return model, images.astype(np.float32)


def main():
  from graphpipe.runtime.launch import initialize_from_env

  initialize_from_env()
  import jax

  from disco import distributed

  model, images = case()
  run = distributed.distribute(model, distributed.node_mesh(2))
  logits = run(images)
  result = {
    "process": jax.process_index(),
    "devices": jax.device_count(),
    "local_weight_bytes": run.device_weight_bytes(),
    "logits": logits.tolist(),
    "bytes_per_inference": run.bytes_per_inference(len(images)),
  }
  print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
  main()
