"""A grammar-compiling child (worker_svc/grammar_pool.py) in which a constraint can be made slow:
one whose text is "slow:PATH|REGEX" writes PATH.held (so a test knows the child is held), waits
until the file PATH exists, then compiles REGEX. Module
level, as the pool's spawned children import their main by name."""
from __future__ import annotations

import os
import time

from worker_svc.grammar_pool import serve_compilations


class _SlowWhereAsked:
    def __init__(self, conn) -> None:
        self.conn = conn

    def recv(self):
        kind, text = self.conn.recv()
        if text.startswith("slow:"):
            path, _, text = text.removeprefix("slow:").partition("|")
            open(path + ".held", "w").close()
            while not os.path.exists(path):
                time.sleep(0.05)
        return kind, text

    def send(self, message) -> None:
        self.conn.send(message)


def serve_with_slow_ones(conn, *args) -> None:
    serve_compilations(_SlowWhereAsked(conn), *args)
