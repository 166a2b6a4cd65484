"""The conformance suite (support/conformance.py) over Qwen3-MoE, GLM-4 MoE and MiniMax-M2."""
from support import conformance

globals().update(conformance.tests("moe"))  # the suite's tests and fixture, as this module's own
