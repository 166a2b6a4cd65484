"""Fingerprint the compiled programs of `generate` for SmolLM2 and its drafter (not a test).

    python -m infer.hlo_fingerprint                 # the prefill and the decode loop, both layouts
    python -m infer.hlo_fingerprint --dump DIR      # also write each program's HLO text there
    python -m infer.hlo_fingerprint --families      # also each target family's tiny target (from a checkout)

A refactor that should not change what runs is checked by running this before and after it (from each
checkout: PYTHONPATH=<checkout> python -m infer.hlo_fingerprint): the fingerprint hashes the optimised
HLO's instructions with their source locations removed, so equal fingerprints mean the same program.
Layouts: "auto" (on a CPU the packed layout the CPU backend decodes) and "stacked" (the XLA backend's).
`--families` builds each family's tiny target of the conformance table (tests/support/families.py, so it
runs from a checkout) with a random one-layer drafter, and fingerprints its generate programs too.
"""
from __future__ import annotations

import argparse
import hashlib
import re
from pathlib import Path

_METADATA = re.compile(r", metadata=\{[^}]*\}| stack_frame_id=\d+")
_INSTRUCTION = re.compile(r"^\s*(ROOT )?%|^ENTRY|^HloModule")


def fingerprint(hlo: str) -> tuple[str, int]:
    """(sha256 prefix, instruction count) of an HLO text's instructions, source locations removed."""
    lines = [_METADATA.sub("", line) for line in hlo.splitlines() if _INSTRUCTION.match(line)]
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16], len(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", default="checkpoints/smollm2-dflash",
                        help="drafter directory (default: %(default)s)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--dump", type=Path, help="write each program's HLO text into this directory")
    parser.add_argument("--families", action="store_true",
                        help="also each target family's tiny target with a random drafter (needs tests/ beside infer/)")
    args = parser.parse_args(argv)
    from dflash_jax import load_drafter, load_target
    from dflash_jax.engine import generator as speculative

    def report(label, generator, temperature=0.0):
        cfg, call, _ = generator._prepare([[1, 2, 3]], max_new_tokens=args.max_new_tokens, temperature=temperature,
                                          top_k=0,
                                          top_p=1.0, stop_token_ids=(), block_size=None, seed=0, acceptance="exact",
                                          lookup=0, min_draft_probability=0.0)
        prefill, loop, _ = generator._executables(cfg, call, "decode")
        for name, executable in (("prefill", prefill), ("loop", loop)):
            text = executable.as_text()
            digest, count = fingerprint(text)
            print(f"{label:12} {name:8} {digest}  ({count} instructions)", flush=True)
            if args.dump:
                args.dump.mkdir(parents=True, exist_ok=True)
                (args.dump / f"{label}_{name}.hlo.txt").write_text(text)

    drafter = load_drafter(args.drafter)
    for layout, backend in (("auto", "auto"), ("stacked", "xla")):
        target = load_target("smollm2", tokenizer=False, layout=layout)
        report(layout, speculative.Generator(target, drafter, backend=backend))
    if args.families:
        import sys

        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        from support.families import FAMILIES, tiny_target
        from support.speculative import tiny_drafter

        for family in FAMILIES:
            target = tiny_target(family)
            report(family, speculative.Generator(target, tiny_drafter(target)))
        # the drafter generations on the tiny Qwen3 target, greedy and sampled
        import jax

        from dflash_jax.cli.bench_random import DRAFTER_GENERATIONS
        from dflash_jax.drafters.drafter import Drafter, init_drafter_params
        from infer.profile_cycle import generation_config

        target = tiny_target("qwen3")
        base = tiny_drafter(target).config
        for generation in DRAFTER_GENERATIONS:
            config = generation_config(base, generation)
            drafter = Drafter(config, init_drafter_params(config, jax.random.PRNGKey(1)))
            for temperature in (0.0, 0.7):
                report(f"{generation}@{temperature:g}", speculative.Generator(target, drafter), temperature)


if __name__ == "__main__":
    main()
