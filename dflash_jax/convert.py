"""Convert DFlash drafters between the official Hugging Face layout and Orbax checkpoints.

  python -m dflash_jax.convert to-orbax  HF_DRAFTER_DIR  ORBAX_DIR  [--dtype bfloat16]
  python -m dflash_jax.convert to-hf     ORBAX_DIR       HF_DRAFTER_DIR  [--dtype bfloat16]

The HF layout (config.json + model.safetensors) is what the official PyTorch code, vLLM, SGLang
and transformers load; the Orbax layout (config.json + params/) is what training writes.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dflash_jax.loading.drafter_io import load_drafter, save_drafter
from dflash_jax.loading.orbax_io import load_orbax_drafter, save_orbax_drafter


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dflash_jax.convert", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (("to-orbax", "official HF drafter directory -> Orbax checkpoint"),
                            ("to-hf", "Orbax checkpoint -> official HF drafter directory")):
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.add_argument("src", help="source directory")
        p.add_argument("dst", help="destination directory (created)")
        p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                       help="cast params (default: keep the source dtype; HF sources load as float32 "
                            "unless config.json says bfloat16)")
    args = parser.parse_args(argv)
    try:
        if args.command == "to-orbax":
            config_file = Path(args.src) / "config.json"
            stored = json.loads(config_file.read_text()).get("dtype") if config_file.is_file() else None
            dtype = args.dtype or ("bfloat16" if stored in ("bfloat16", "bf16") else "float32")
            out = save_orbax_drafter(load_drafter(args.src, dtype=dtype), args.dst)
        else:
            out = save_drafter(load_orbax_drafter(args.src, args.dtype), args.dst)
    except (FileNotFoundError, FileExistsError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
