"""`python -m infer.demo` (what `make demo` runs): the program is `dflash_jax.cli.demo`, see --help."""
from __future__ import annotations

from dflash_jax.cli.common import exit_process
from dflash_jax.cli.demo import main

if __name__ == "__main__":
    exit_process(main())
