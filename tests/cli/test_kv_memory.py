"""`python -m infer.kv_memory`: the KV cache a slot holds, from the shapes generation allocates, and
the paged comparison's arithmetic (nothing allocated)."""
from __future__ import annotations

import numpy as np

from infer import kv_memory


def test_a_qwen3_8b_slot_holds_the_target_and_drafter_caches_at_the_loop_capacity(capsys):
    kv_memory.main(["--max-tokens", "8192", "--slots", "32", "64"])
    out = capsys.readouterr().out
    # 36 layers x 8 kv heads x 128 x (keys, values) x 2 bytes; the drafter's 5 layers likewise
    assert "target 147,456 B per token" in out and "drafter 20,480 B per token" in out
    # capacity: 8,192 + block 16 rounded up to the key tile of 64; 8,256 x 167,936 B = 1.291 GiB a slot
    assert "| 8,192 | 8,256 | 1.291 GiB (1.134 + 0.157) | 32 | 41.3 GiB |" in out
    assert "| 32 | 41.3 GiB | 58.5 GiB | yes | 45 |" in out and "| 64 | 82.6 GiB | 99.9 GiB | NO | 45 |" in out


def test_in_flight_sequences_hold_whole_pages_within_the_slot():
    rng = np.random.default_rng(0)
    held = kv_memory.in_flight_tokens(rng, "long", 4096, 16, 16, 10_000)
    assert held.min() >= 16 and held.max() <= 4096 + 16 + 16 and np.all(held % 16 == 0)
    # weighted by output length, a sequence in flight holds more than a sequence's prompt on average
    assert held.mean() > kv_memory.DISTRIBUTIONS["long"][0]
