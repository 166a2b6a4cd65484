"""The conformance suite (support/conformance.py) over Qwen3, Llama, gpt-oss and Gemma 4."""
from support import conformance

globals().update(conformance.tests("dense"))  # the suite's tests and fixture, as this module's own
