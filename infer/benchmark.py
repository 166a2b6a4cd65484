"""`python -m infer.benchmark`: the in-repository entry point of the benchmark (installed as
`dflash-benchmark`); the program itself is `dflash_jax.cli.benchmark`, see its --help."""
from __future__ import annotations

from typing import Sequence

from dflash_jax.cli import benchmark as _cli
from dflash_jax.cli.common import exit_process

PROG = "python -m infer.benchmark"


def main(argv: Sequence[str] | None = None) -> int:
    return _cli.main(argv, prog=PROG)


if __name__ == "__main__":
    exit_process(main())
