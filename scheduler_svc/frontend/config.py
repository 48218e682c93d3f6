"""A frontend process's settings (every frontend of a scheduler has the same): one dataclass
whose fields are also the scheduler's flags (common.cli.flag)."""
from __future__ import annotations

import argparse
from dataclasses import dataclass

from common.cli import config_from_args, flag
from scheduler_svc.frontend.limit_flags import limits_from_args
from scheduler_svc.frontend.validation import DEFAULT_LIMITS, Limits

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
    allow_chat_special_tokens: bool = flag(
        False, group=FRONTENDS, help="let the text of chat messages write special tokens (<|im_start|>, ...) as control "
                                     "tokens, for trusted clients that write template structure on purpose; without "
                                     "it they are tokenized as plain text")
    limits: Limits = DEFAULT_LIMITS     # the request limits' flags (scheduler_svc/frontend/limit_flags.py)


def frontend_config_from_args(args: argparse.Namespace) -> FrontendConfig:
    """The frontends' settings from the scheduler's flags, with the request limits'."""
    return config_from_args(FrontendConfig, args, limits=limits_from_args(args))
