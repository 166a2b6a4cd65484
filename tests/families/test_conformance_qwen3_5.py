"""The conformance suite (support/conformance.py) over Qwen3.5 and Qwen3-Next."""
from support import conformance

globals().update(conformance.tests("qwen3_5"))  # the suite's tests and fixture, as this module's own
