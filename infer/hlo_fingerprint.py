"""Fingerprint the compiled programs of `generate` for SmolLM2 and its drafter (not a test).

    python -m infer.hlo_fingerprint                 # the prefill and the decode loop, both layouts
    python -m infer.hlo_fingerprint --dump DIR      # also write each program's HLO text there

A refactor that should not change what runs is checked by running this before and after it (from each
checkout: PYTHONPATH=<checkout> python -m infer.hlo_fingerprint): the fingerprint hashes the optimised
HLO's instructions with their source locations removed, so equal fingerprints mean the same program.
Layouts: "auto" (on a CPU the packed layout the CPU backend decodes) and "stacked" (the XLA backend's).
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
    args = parser.parse_args(argv)
    from dflash_jax import _speculative as speculative, load_drafter, load_target

    drafter = load_drafter(args.drafter)
    for layout, backend in (("auto", "auto"), ("stacked", "xla")):
        target = load_target("smollm2", tokenizer=False, layout=layout)
        generator = speculative.Generator(target, drafter, backend=backend)
        cfg, call, _ = generator._prepare([[1, 2, 3]], max_new_tokens=args.max_new_tokens, temperature=0.0, top_k=0,
                                          top_p=1.0, stop_token_ids=(), block_size=None, seed=0, acceptance="exact",
                                          lookup=0, min_draft_probability=0.0)
        prefill, loop, _ = generator._executables(cfg, call, "decode")
        for name, executable in (("prefill", prefill), ("loop", loop)):
            text = executable.as_text()
            digest, count = fingerprint(text)
            print(f"{layout:8} {name:8} {digest}  ({count} instructions)")
            if args.dump:
                args.dump.mkdir(parents=True, exist_ok=True)
                (args.dump / f"{layout}_{name}.hlo.txt").write_text(text)


if __name__ == "__main__":
    main()
