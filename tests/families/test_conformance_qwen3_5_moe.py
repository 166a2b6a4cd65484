"""The conformance suite (support/conformance.py) over Qwen3.5-MoE."""
from support import conformance

globals().update(conformance.tests("qwen3_5_moe"))  # the suite's tests and fixture, as this module's own
