"""Command-line programs, installed as console scripts (dflash-generate, dflash-benchmark,
dflash-convert, dflash-train) and run in the repository as `python -m infer.generate` etc.
`common` holds what they share; nothing in the library imports this package."""
