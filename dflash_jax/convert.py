"""Convert DFlash drafters between the official Hugging Face layout, PyTorch .bin and Orbax.

  python -m dflash_jax.convert to-orbax  HF_DRAFTER_DIR      ORBAX_DIR       [--dtype bfloat16]
  python -m dflash_jax.convert to-hf     ORBAX_OR_BIN_DIR    HF_DRAFTER_DIR  [--dtype bfloat16] [--force]
                                         [--layout auto|official|speculators]

The HF layout (config.json + model.safetensors) is what the official PyTorch code, vLLM, SGLang
and transformers load; the Orbax layout (config.json + params/) is what training writes. A drafter
saved as pytorch_model.bin (or sharded, with pytorch_model.bin.index.json) is read with torch, so
converting it once (`to-hf` or `to-orbax`) is the one step that needs torch installed. A DSpark
drafter is written in DeepSpec's layout or, with `--layout speculators`, as speculators'
`DSparkSpeculator` (`save_drafter`'s `layout`).
Installed as the console script `dflash-convert`.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dflash_jax.formats.dtypes import stored_dtype_name
from dflash_jax.loading.drafter_io import load_drafter, save_drafter
from dflash_jax.loading.orbax_io import load_orbax_drafter, save_orbax_drafter
from dflash_jax.models.config import read_config_json

EXIT_ERROR = 2


def _load_source(src: Path, dtype: str | None):
    """An Orbax checkpoint (DIR/params) or a Hugging Face drafter directory (safetensors or .bin),
    kept in its stored dtype unless `dtype` is given."""
    if (src / "params").is_dir():
        return load_orbax_drafter(src, dtype)
    if not src.is_dir():
        raise FileNotFoundError(f"source directory does not exist: {src}")
    return load_drafter(src, dtype=dtype or stored_dtype_name(read_config_json(src)))


def build_parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (("to-orbax", "official HF drafter directory (safetensors or pytorch_model.bin) "
                                         "-> Orbax checkpoint"),
                            ("to-hf", "Orbax checkpoint or pytorch_model.bin drafter directory -> official "
                                      "HF drafter directory (config.json + model.safetensors)")):
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.add_argument("src", type=Path, help="source directory")
        p.add_argument("dst", type=Path, help="destination directory (created)")
        p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                       help="cast params (default: keep the dtype config.json states; float32 if none)")
        if name == "to-hf":
            p.add_argument("--layout", choices=["auto", "official", "speculators"], default="auto",
                           help="the checkpoint layout written: official (DFlash, DFlash2, DeepSpec's DSpark), "
                                "speculators (a DSpark drafter as DSparkSpeculator), auto (default: the source's)")
            p.add_argument("--force", action="store_true",
                           help="replace an existing non-empty destination (written to a temporary "
                                "directory first, then swapped in)")
    return parser


def main(argv=None, prog: str = "python -m dflash_jax.convert") -> int:
    args = build_parser(prog).parse_args(argv)
    try:
        drafter = _load_source(args.src, args.dtype)
        if args.command == "to-orbax":
            out = save_orbax_drafter(drafter, args.dst)
        else:
            out = save_drafter(drafter, args.dst, overwrite=args.force, layout=args.layout)
    except (OSError, ValueError) as e:  # missing/damaged files, bad config, torch missing, dst exists
        print(f"error: {e}", file=sys.stderr)
        return EXIT_ERROR
    print(f"wrote {out}")
    return 0


def console_main() -> int:
    """Entry point of the `dflash-convert` console script."""
    return main(prog="dflash-convert")


if __name__ == "__main__":
    sys.exit(main())
