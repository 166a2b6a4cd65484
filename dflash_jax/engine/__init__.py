"""The host side of generation: what a call asks for, checked (`options`), `Generator`, `generate` and
`generate_stream` with their results (`generator`), and the continuous-batching engine (`batch`)."""
