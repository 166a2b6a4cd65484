"""Checkpoint formats and name tables, below the families that use them: the declarative name table
(`names`), safetensors and `.bin` files (`safetensors_io`, `checkpoint_files`), dtypes, the quantised
layouts released checkpoints use (FP8 blocks and channels, INT4 packs, MXFP4) and GGUF files
(`gguf_*`). The loaders that build models from them are `dflash_jax.loading`."""
