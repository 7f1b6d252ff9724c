"""The tiny checkpoints of the families beyond Llama that the parity tests run: each one's own features
switched on at sizes where they matter (windows shorter than the prompts, not block-aligned; soft-caps low
enough to bend the scores; experts that tokens really split over)."""

from __future__ import annotations

from typing import Any

WINDOW = 20  # tokens; blocks are 16, prompts reach 70+
GEMMA3_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
               "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0}}

FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "mistral-window": ("MistralForCausalLM", {"sliding_window": WINDOW}),
    "phi3": ("Phi3ForCausalLM", {"sliding_window": WINDOW}),  # q/k/v and gate/up fused in the checkpoint
    # Sliding layers alternate with global ones; scores and logits soft-capped.
    "gemma2": ("Gemma2ForCausalLM", {"sliding_window": WINDOW, "attn_logit_softcapping": 5.0,
                                     "final_logit_softcapping": 8.0, "query_pre_attn_scalar": 16}),
    # One sliding and one global layer, each with its own RoPE (the global one linearly scaled); q/k norms.
    "gemma3": ("Gemma3ForCausalLM", {"sliding_window": WINDOW, "rope_parameters": GEMMA3_ROPE,
                                     "layer_types": ["sliding_attention", "full_attention"]}),
    "mixtral": ("MixtralForCausalLM", {"sliding_window": WINDOW}),  # top-2 of 4, renormalised
    "qwen2-moe": ("Qwen2MoeForCausalLM", {}),  # top-2 of 4 not renormalised, a gated shared expert
    # Renormalised top-2; layer 0 keeps a dense MLP (mlp_only_layers).
    "qwen3-moe": ("Qwen3MoeForCausalLM", {"mlp_only_layers": [0]}),
}
