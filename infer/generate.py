"""`python -m infer.generate`: the in-repository entry point of the generate CLI (installed as
`dflash-generate`); the program itself is `dflash_jax.cli.generate`, see its --help."""
from __future__ import annotations

from typing import Sequence

from dflash_jax.cli import generate as _cli
from dflash_jax.cli.common import exit_process

PROG = "python -m infer.generate"


def main(argv: Sequence[str] | None = None) -> int:
    return _cli.main(argv, prog=PROG)


if __name__ == "__main__":
    exit_process(main())
