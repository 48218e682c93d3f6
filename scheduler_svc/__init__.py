"""The scheduler service: request lifecycle, paged KV block tables with prefix caching,
continuous batching with chunked prefill and preemption, and token/text streaming."""
