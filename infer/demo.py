"""`python -m infer.demo` (what `make demo` runs): the program is `dflash_jax.cli.demo`, see --help."""
from __future__ import annotations

import sys

from dflash_jax.cli.demo import main

if __name__ == "__main__":
    sys.exit(main())
