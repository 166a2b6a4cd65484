"""dflash-jax: DFlash block-diffusion speculative decoding in JAX/Flax."""
