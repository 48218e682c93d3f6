"""What the gateway's application needs to know: one dataclass, which __main__.py fills from the
command line (its flags take their defaults from here). Light to import: no FastAPI, no gRPC."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class GatewayConfig:
    target: str | None                             # the scheduler's llm.v1 address (None: the client's default)
    api_keys: Sequence[str] = ()                   # empty: /v1/* is open
    request_timeout: float | None = 600.0          # deadline of each gRPC call (None: none)
    client_options: dict[str, Any] = field(default_factory=dict)   # AsyncClient's TLS and token arguments
    max_request_bytes: int = 8 << 20               # of a request body (0: no bound)
    # JSON values of a request body, counted by its commas, colons, [ and { as it arrives (0: no bound):
    # parsing costs by values, on the event loop that writes every stream.
    max_request_values: int = 1 << 19
    max_sequences_per_request: int = 256           # a completion's prompts x n
    body_timeout: float | None = 60.0              # seconds for a request's body to arrive (None: none)
