"""`dflash-train`: the training entry point (`python -m train.train` in the repository)."""
from __future__ import annotations

import sys
from typing import Sequence

from dflash_jax.cli.common import run_checkout_module


def main(argv: Sequence[str] | None = None) -> int:
    return run_checkout_module("train.train", argv)


if __name__ == "__main__":
    sys.exit(main())
