"""graphpipe: graph pipeline parallelism for JAX / Flax."""
