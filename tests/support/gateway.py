"""Starts the OpenAI gateway (`python -m gateway`) as a process in front of a running scheduler,
for end-to-end tests; waits until its /health answers 200."""
from __future__ import annotations

import contextlib
import os
import pathlib
import subprocess
import sys
import time
import urllib.error
import urllib.request

from tests.support.procs import REPO, free_port


@contextlib.contextmanager
def running_gateway(scheduler_addr: str, log: pathlib.Path, *extra: str, timeout: float = 60.0):
    """Yields the gateway's base URL (http://127.0.0.1:PORT); stops the process on exit."""
    port = free_port()
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "gateway", "--target", scheduler_addr, "--host", "127.0.0.1",
                             "--port", str(port), *extra],
                            cwd=REPO, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the gateway exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
            with contextlib.suppress(urllib.error.URLError, OSError):
                with urllib.request.urlopen(f"{base}/health", timeout=2) as reply:
                    if reply.status == 200:
                        break
            if time.monotonic() > deadline:
                raise TimeoutError(f"the gateway is not healthy after {timeout} s:\n{log.read_text()[-4000:]}")
            time.sleep(0.1)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
