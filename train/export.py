"""Export a trained drafter to the official DFlash layout (config.json + model.safetensors).

    python -m train.export RUN_DIR OUT_DIR [--step N] [--dtype bfloat16] [--block-size G] [--force]

RUN_DIR is a `train.train` run directory (its latest checkpoint unless --step). The full-vocabulary
layout is the official one (loadable by the official PyTorch code, vLLM and SGLang). A run with a
reduced draft vocabulary also writes, in EAGLE-3's convention as vLLM and SpecForge read it, the
tensors `d2t` (int64 [Vd]: target_id = draft_id + d2t[draft_id]), `t2d` (bool [V]) and the
drafter's own `lm_head.weight` [Vd, D], and `draft_vocab_size` in config.json.
--block-size writes another block size into config.json than the run trained with (it is not a
weight shape): the block `generate` drafts by default, chosen by measuring (`infer.benchmark
--block-size G`). The output directory appears in one rename; an existing one is replaced only
with --force.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

from dflash_jax.drafters.config import DrafterConfig
from dflash_jax.drafters.draft_vocab import DraftVocab
from dflash_jax.drafters.drafter import Drafter
from dflash_jax.formats.dtypes import resolve_dtype
from dflash_jax.loading.drafter_io import save_drafter
from dflash_jax.models.config import read_config_json
from train import checkpointing
from train.train import VOCAB_FILE


def export(run_dir: str | Path, out_dir: str | Path, *, step: int | None = None, dtype: str = "bfloat16",
           force: bool = False, block_size: int | None = None) -> Path:
    run_dir, out_dir = Path(run_dir), Path(out_dir)
    hf = read_config_json(run_dir / "drafter")
    config = DrafterConfig.from_hf_config(hf)
    if block_size is not None:
        if block_size < 2:
            raise ValueError(f"--block-size must be >= 2 (the anchor and at least one draft), got {block_size}")
        config = dataclasses.replace(config, block_size=block_size)
        hf = {**hf, "block_size": block_size}
    step, params = checkpointing.restore_params(run_dir, step)
    dtype = resolve_dtype(dtype)
    drafter = Drafter(config, jax.tree.map(lambda p: jnp.asarray(p, dtype), params["drafter"]), hf, dtype)
    if "draft_head" in params:
        drafter = drafter.with_draft_vocab(params["draft_head"], DraftVocab.load(run_dir / VOCAB_FILE))
    return save_drafter(drafter, out_dir, overwrite=force)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m train.export", description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", help="a train.train run directory (run.out_dir)")
    p.add_argument("out_dir", help="the drafter directory to write")
    p.add_argument("--step", type=int, help="checkpoint step (default: the latest)")
    p.add_argument("--dtype", default="bfloat16", help="bfloat16 (official) or float32")
    p.add_argument("--block-size", type=int, help="block size written to config.json (default: the run's)")
    p.add_argument("--force", action="store_true", help="replace an existing out_dir")
    args = p.parse_args(argv)
    try:
        out = export(args.run_dir, args.out_dir, step=args.step, dtype=args.dtype, force=args.force,
                     block_size=args.block_size)
    except (FileNotFoundError, FileExistsError, ValueError, checkpointing.CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
