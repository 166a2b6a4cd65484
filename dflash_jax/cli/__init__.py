"""Command-line programs, installed as console scripts (dflash-generate, dflash-benchmark,
dflash-convert) and run in the repository as `python -m infer.generate` etc. (training runs from a
checkout, `python -m train.train`).
`common` holds what they share; nothing in the library imports this package."""
