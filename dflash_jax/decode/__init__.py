"""The device side of generation: token distributions and the lossless acceptance rules (`sampling`),
drafts looked up in a row's own text (`lookup`), and the decode state, prefill, speculative cycle and
`lax.while_loop` (`loop`). Pure functions of static specs and explicit params and state; the drafter's
proposal comes from its generation (`dflash_jax.drafters.generations`), so nothing here imports a
drafter."""
