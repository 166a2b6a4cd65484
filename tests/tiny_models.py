"""Tiny random Hugging Face models built locally (no hub), saved with save_pretrained."""
from __future__ import annotations

import torch

QWEN3 = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
             max_position_embeddings=256, tie_word_embeddings=False)
LLAMA = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=1, rms_norm_eps=1e-5,
             max_position_embeddings=256, tie_word_embeddings=True)


def make_hf_model(kind: str, out_dir, seed: int = 0, **overrides):
    """Build, randomise (norm weights too), save; return the float32 torch model in eval mode."""
    import transformers

    torch.manual_seed(seed)
    if kind == "qwen3":
        config = transformers.Qwen3Config(**{**QWEN3, **overrides})
        model = transformers.Qwen3ForCausalLM(config)
    elif kind == "llama":
        config = transformers.LlamaConfig(**{**LLAMA, **overrides})
        model = transformers.LlamaForCausalLM(config)
    else:
        raise ValueError(kind)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.05 * torch.randn_like(p))
    model.eval()
    model.save_pretrained(out_dir)
    return model
