"""A loaded model (weights, tokenizer) forwards its pure functions to its static spec.

`TargetSpec` and `DrafterSpec` are frozen and hashable: jitted code takes one as a static argument
and the params as arguments, so weights are never compiled in as constants. `Target` and `Drafter`
hold the weights beside the spec and expose the spec's functions for convenience.
"""
from __future__ import annotations


def on_spec(name: str):
    """A method that calls `self.spec.<name>` with the same arguments."""
    def call(self, *args, **kwargs):
        return getattr(self.spec, name)(*args, **kwargs)

    call.__name__ = name
    call.__doc__ = f"The spec's `{name}` (same arguments, params passed explicitly)."
    return call
