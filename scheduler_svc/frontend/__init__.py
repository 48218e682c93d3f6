"""The frontend processes: the public llm.v1 API (validation, tokenization, chat, detokenization, stop strings, client streams)."""
