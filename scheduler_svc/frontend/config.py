"""A frontend process's settings (every frontend of a scheduler has the same): one dataclass
whose fields are also the scheduler's flags (common.cli.flag)."""
from __future__ import annotations

from dataclasses import dataclass

from common.cli import flag

FRONTENDS = "frontends"


@dataclass(frozen=True)
class FrontendConfig:
    served_model_name: str | None = flag(None, group=FRONTENDS,
                                         help="name reported in ModelInfo (unset: the model directory's name)")
    host: str = flag("127.0.0.1", group=FRONTENDS, help="address of the public API (0.0.0.0: every interface)")
    port: int = flag(50051, group=FRONTENDS, help="port of the public API")
    stream_interval: int = flag(1, group=FRONTENDS,
                                help="tokens per streamed message (the first comes at once; the last carries the "
                                     "rest): larger values trade inter-token latency for CPU")
    stream_window: int = flag(256, group=FRONTENDS,
                              help="tokens a request may be generated ahead of what its client has read (tokens the "
                                   "client's HTTP/2 stream window holds count as read); past it the request leaves "
                                   "the batch until the client reads again (0: no bound; else at least twice "
                                   "--stream-interval)")

