"""How a decoder's layers are grouped into scanned segments.

Each layer has a kind, (token mixer, MLP) (`ModelConfig.layer_kinds`). The stack is cut into segments,
each the repeats of one pattern of kinds, scanned over its repeats (`nn.scan`, params stacked
[repeats, ...]): Llama or Qwen3 is one segment of a one-layer pattern, gpt-oss one segment of
(sliding, full), a Qwen3.5 hybrid one segment of (linear x 3, full), and a Qwen3-MoE with dense layers
among its sparse ones (`mlp_only_layers`) as many segments as its runs of kinds need. A segment's
params sit under "layers" when there is one segment, "layers_{s}" otherwise, then "layer_{p}" for its
position p; a stack of identical attention layers (`is_direct`) has its params right under "layers".
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

MAX_PATTERN = 8  # the longest pattern looked for (Qwen3.5 uses 4; a longer one is unrolled in each repeat)


@dataclasses.dataclass(frozen=True)
class Segment:
    start: int  # its first layer
    pattern: tuple  # the kinds of one repeat
    repeats: int

    @property
    def stop(self) -> int:
        return self.start + len(self.pattern) * self.repeats

    def layer_ids(self, position: int) -> tuple[int, ...]:
        """The layers at `position` of the pattern, in order (what its params stack)."""
        return tuple(range(self.start + position, self.stop, len(self.pattern)))


def stack_segments(kinds: Sequence) -> tuple[Segment, ...]:
    """The segments of a stack of layers of `kinds`: from the first layer on, the pattern (of at most
    MAX_PATTERN layers) whose repeats save the most layer bodies from being traced apart (the layers
    it covers less its own length; the shortest such pattern on a tie): a dense prefix before 47 MoE
    layers is a segment of one layer, then one of 47 repeats of one."""
    kinds, segments, start = tuple(kinds), [], 0
    while start < len(kinds):
        best = None
        for period in range(1, min(MAX_PATTERN, len(kinds) - start) + 1):
            pattern = kinds[start:start + period]
            repeats = 1
            while kinds[start + repeats * period:start + (repeats + 1) * period] == pattern:
                repeats += 1
            if best is None or period * (repeats - 1) > len(best[0]) * (best[1] - 1):
                best = (pattern, repeats)
        segments.append(Segment(start, *best))
        start = segments[-1].stop
    return tuple(segments)


def is_direct(config) -> bool:
    """Every layer alike and no recurrent state (Llama, Qwen3, an all-MoE Qwen3-MoE): the layers are one
    scan over a layer module, params stacked [L, ...] under "layers", and a backend may run its own loop
    over them (`backends.base.Backend.layer_loop`)."""
    segments = stack_segments(config.layer_kinds)
    return len(segments) == 1 and len(segments[0].pattern) == 1 and not config.family.stateful_mixers


def segment_path(segments: Sequence[Segment], s: int, position: int, direct: bool = False) -> tuple[str, ...]:
    """The param path of position `position` of segment `s`'s pattern (direct: `is_direct`)."""
    if direct:
        return ("layers",)
    head = ("layers",) if len(segments) == 1 else (f"layers_{s}",)
    return (*head, f"layer_{position}")
