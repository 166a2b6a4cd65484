"""Building blocks every model is made of: the attention seam (`attention`: the kernel or its reference,
picked per platform from `dflash_jax.kernels`), RMSNorm, rotary embeddings, SwiGLU MLPs and attention
projections (`common`), and mixture-of-experts MLPs (`moe`). Above the kernels and the backends, below
the models."""
