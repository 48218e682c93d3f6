"""An OpenAI-compatible HTTP gateway in front of the scheduler's llm.v1 gRPC API: /v1/completions,
/v1/chat/completions, /v1/responses (streamed as server-sent events, or not), /v1/models, vLLM's
/tokenize and /detokenize, /health and /metrics.

It is a separate, optional process (`qwen3-serve gateway`): it holds no model files, speaks llm.v1
to the scheduler through common.client.AsyncClient, and maps gRPC failures to HTTP statuses with
OpenAI's error body. app.py builds the application; __main__.py serves it (docs/GATEWAY.md).
"""
