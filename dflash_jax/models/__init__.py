"""The target model, written once for every family: its config (`config`), the family registry it
looks families up in (`registry`), the static-shape caches and their protocol (`cache`), how the stack
is cut into scanned segments (`stack`), the pre-norm decoder layer (`decoder_layer`), the target module
and its spec (`target`), and how a loaded model forwards to its spec (`spec`). What only one family
has (Qwen3.5's recurrent state, DeepSeek-V3's latent cache) lives in that family's module."""
