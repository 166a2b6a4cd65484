"""An independent PyTorch reference of the DFlash drafter forward, built from transformers' Qwen3
blocks and the description in docs/architecture.md, with the official parameter names."""
from __future__ import annotations

import json

import torch
from torch import nn
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding, rotate_half


def drafter_hf_config(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, inter=128, vocab=128,
                      num_target_layers=4, block_size=8, mask_token_id=127, target_layer_ids=(1, 3),
                      layer_types=None, sliding_window=None):
    cfg = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": hidden,
        "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": head_dim, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "rope_scaling": None, "max_position_embeddings": 512,
        "vocab_size": vocab, "num_target_layers": num_target_layers, "block_size": block_size,
        "dflash_config": {"mask_token_id": mask_token_id}, "tie_word_embeddings": False,
        "attention_bias": False, "dtype": "float32",
        "layer_types": layer_types or ["full_attention"] * layers, "sliding_window": sliding_window,
    }
    if target_layer_ids is not None:
        cfg["dflash_config"]["target_layer_ids"] = list(target_layer_ids)
    return cfg


class RefAttention(nn.Module):
    def __init__(self, c: Qwen3Config):
        super().__init__()
        self.h, self.kv, self.d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, self.h * self.d, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, self.kv * self.d, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, self.kv * self.d, bias=False)
        self.o_proj = nn.Linear(self.h * self.d, c.hidden_size, bias=False)
        self.q_norm = Qwen3RMSNorm(self.d, eps=c.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.d, eps=c.rms_norm_eps)

    def forward(self, x, ctx, cos, sin, visible):
        b, g, _ = x.shape
        c = ctx.shape[1]
        q = self.q_norm(self.q_proj(x).view(b, g, self.h, self.d)).transpose(1, 2)
        k = torch.cat([self.k_proj(ctx), self.k_proj(x)], 1).view(b, c + g, self.kv, self.d)
        v = torch.cat([self.v_proj(ctx), self.v_proj(x)], 1).view(b, c + g, self.kv, self.d)
        k = self.k_norm(k).transpose(1, 2)
        v = v.transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [b, 1, c+g, d]
        q = q * cos[:, :, c:] + rotate_half(q) * sin[:, :, c:]
        k = k * cos + rotate_half(k) * sin
        rep = self.h // self.kv
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        scores = (q @ k.transpose(-1, -2)) * self.d**-0.5
        scores = scores.masked_fill(~visible[:, None], float("-inf"))
        out = torch.softmax(scores, -1) @ v
        return self.o_proj(out.transpose(1, 2).reshape(b, g, -1))


class RefLayer(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.self_attn = RefAttention(c)
        self.mlp = Qwen3MLP(c)
        self.input_layernorm = Qwen3RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(c.hidden_size, eps=c.rms_norm_eps)

    def forward(self, x, ctx, cos, sin, visible):
        x = x + self.self_attn(self.input_layernorm(x), ctx, cos, sin, visible)
        return x + self.mlp(self.post_attention_layernorm(x))


class RefDrafter(nn.Module):
    def __init__(self, hf: dict):
        super().__init__()
        c = Qwen3Config(**{k: v for k, v in hf.items() if k not in ("architectures", "dflash_config")})
        self.hf = hf
        n = len(hf["dflash_config"].get("target_layer_ids", range(c.num_hidden_layers)))
        self.layers = nn.ModuleList([RefLayer(c) for _ in range(c.num_hidden_layers)])
        self.fc = nn.Linear(n * c.hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.norm = Qwen3RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.rotary = Qwen3RotaryEmbedding(c)

    def forward(self, features, noise, window=None):
        """Context features [b, c, n*D] at positions 0..c-1; block [b, g, D] at c..c+g-1."""
        b, c, _ = features.shape
        g = noise.shape[1]
        ctx = self.hidden_norm(self.fc(features))
        pos = torch.arange(c + g)[None].expand(b, -1)
        cos, sin = self.rotary(noise, pos)
        x = noise
        for i, layer in enumerate(self.layers):
            x = layer(x, ctx, cos, sin, self.visible(i, c, g).expand(b, -1, -1))
        return self.norm(x)

    def visible(self, layer: int, c: int, g: int):
        """[1, g, c + g] of the authors' current rule over positions (queries at c..c+g-1, keys at
        0..c+g-1): is_causal absent -> sliding layers causal, full ones not; a window keeps
        q - k < W, and for a non-causal layer also k - q < W."""
        sliding = self.hf["layer_types"][layer] == "sliding_attention"
        causal = self.hf.get("is_causal")
        causal = sliding if causal is None else bool(causal)
        q = torch.arange(c, c + g)[:, None]
        k = torch.arange(c + g)[None, :]
        vis = torch.ones(g, c + g, dtype=torch.bool)
        if causal:
            vis &= k <= q
        if sliding:
            w = self.hf["sliding_window"]
            vis &= q - k < w
            if not causal:
                vis &= k - q < w
        return vis[None]


def write_official_checkpoint(out_dir, hf: dict, seed=0) -> RefDrafter:
    """Random weights (norms too) saved exactly as the official release names them."""
    from safetensors.torch import save_file

    torch.manual_seed(seed)
    model = RefDrafter(hf)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else 0.05 * torch.randn_like(p))
    model.eval()
    state = {k: v.contiguous() for k, v in model.state_dict().items() if "rotary" not in k}
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(hf, indent=2))
    return model
