"""The engine core process: scheduling, block tables and the worker connections (no tokenizer, no client streams)."""
