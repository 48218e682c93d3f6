"""The worker service: Qwen3 weights, the paged KV cache, forward passes and sampling."""
