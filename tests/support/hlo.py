"""The structural check on optimised HLO (tests/decode/test_decode_hlo.py): nothing but in-place row updates
touches a whole cache buffer, so a step's cost does not grow with the cache capacity.

The capacity is a number no other dimension has (1000); any instruction whose result carries that
dimension must be a parameter, an alias (get-tuple-element, bitcast) or an in-place
dynamic-update-slice (alone or as the root of a fusion). A copy, a scatter, an elementwise pass
or a slice of a whole layer of the cache is reported.
"""
from __future__ import annotations

import re

import jax

CAPACITY = 1000

_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%(\S+)\s.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(ROOT\s+)?%(\S+)\s*=\s*\w+\[([\d,]*)\]\S*\s+([\w-]+)\(")
_ALIASES = {"parameter", "get-tuple-element", "bitcast", "dynamic-update-slice"}


def whole_buffer_ops(hlo: str, capacity: int = CAPACITY) -> list[str]:
    """Instructions of the HLO text whose array result has a `capacity` dimension and that are not
    a parameter, an alias or an in-place dynamic-update-slice (or a fusion rooted in one)."""
    roots, instructions, computation = {}, [], None
    for line in hlo.splitlines():
        if (match := _COMPUTATION.match(line)) is not None:
            computation = match.group(1)
            continue
        if (match := _INSTRUCTION.match(line)) is None:
            continue
        root, name, dims, opcode = match.groups()
        if root:
            roots[computation] = opcode
        if str(capacity) in dims.split(","):
            instructions.append((name, opcode, line.strip()))
    if not instructions:  # the check would pass whatever the program did
        raise AssertionError(f"no instruction of the HLO has a dimension of {capacity}: is it the cache's capacity?")
    flagged = []
    for name, opcode, line in instructions:
        if opcode in _ALIASES:
            continue
        called = re.search(r"calls=%(\S+?)[,\s]", line + " ")
        if opcode == "fusion" and called and roots.get(called.group(1)) == "dynamic-update-slice":
            continue
        flagged.append(f"{opcode} {name}: {line[:160]}")
    return flagged


def compiled_text(fn, *args, donate=()):
    return jax.jit(fn, donate_argnums=donate).lower(*args).compile().as_text()
