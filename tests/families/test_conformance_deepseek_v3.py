"""The conformance suite (support/conformance.py) over DeepSeek-V3."""
from support import conformance

globals().update(conformance.tests("deepseek_v3"))  # the suite's tests and fixture, as this module's own
