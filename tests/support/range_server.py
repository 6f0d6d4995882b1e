"""A small threaded HTTP/1.1 server of a directory's files with `Range` support, and switches to
misbehave, for tests of reading objects by URL (and `benches/remote.py`).

Every fault is chosen by request count, never by timing, so the tests that use them are
deterministic:

- ``latency``: seconds slept before each response (benchmarks only);
- ``fail_nth`` / ``fail_every``: the Nth GET (1-based), or every Kth, is cut off after half of its
  body (``fail_mode="midway"``: headers with the full Content-Length, half the bytes, then the
  connection is closed) or answered 500 (``fail_mode="status"``);
- ``truncate``: every GET body is cut off after half (a connection that always drops);
- ``status``: answer every request with this status (403, 404 ...);
- ``ignore_range``: answer ranged GETs with 200 and the whole file;
- ``stall_after``: every GET sends its headers and this many body bytes, then nothing until the
  server is reset or stopped (a stalled server);
- ``shift``: every ranged GET that does not start at 0 (the opening probe is left whole, so the
  header parses) answers the range asked under correct headers with the bytes this many bytes
  further on (zeros past the end): data that nothing in the protocol tells apart;
- ``overlong``: every ranged GET answers 206 for the range asked, then sends this many bytes
  more than the range;
- ``error_body``: with ``status``, the error response's body has this many bytes;
- ``require_query``: a request whose query string is not exactly this is answered 403 (a
  presigned URL's signature, a token);
- ``busy``: the next this many requests are answered 503 with ``Retry-After: busy_for`` seconds;
- ``redirect_to``: every request is answered 302 to this prefix + its path and query (``"self"``:
  to this server's own URL, a loop), as the Hub's ``resolve`` answers with its storage's URL;
- ``wrong_linked_etag``: the ``X-Linked-Etag`` of every ``resolve`` answer (below) is the SHA-256
  of other bytes (a Hub that names another file than its storage serves).

The Hub API's folder listing is answered too: ``GET /api/{models|datasets|spaces}/ORG/REPO/tree/
REVISION/PATH`` lists ``[datasets/|spaces/]ORG/REPO/resolve/REVISION/PATH`` under the root (where
the ``resolve`` URLs find their files) as the Hub does, a JSON array of ``{"type", "path", "size"}``.

Answers to a ``resolve`` URL (``/[datasets/|spaces/]ORG/REPO/resolve/REVISION/PATH``: the
redirect, or the file itself) carry what the Hub reports of the file: a ``.safetensors`` file is
stored as the Hub stores large files (LFS, Xet), with ``X-Linked-Etag: "<its SHA-256>"`` and
``X-Linked-Size``; the redirect's ``ETag`` is the file's git blob id (40 hex digits, no SHA-256).

Each file's ETag changes when it is rewritten; a request whose ``If-Match`` names another ETag is
answered 412, as object stores answer it.

``requests`` records (method, path, requested range or None, status, body bytes sent) for each,
logged before any of its response goes out (so a client holding a response finds it logged);
``authorizations`` the ``Authorization`` header of each request (None where there was none).

    python tests/support/range_server.py DIR [--port 0] [--latency 0.005]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Dict, List, Optional, Tuple

Record = Tuple[str, str, Optional[Tuple[int, int]], int, int]


class RangeServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    # socketserver's default backlog of 5 drops the SYNs of many parallel clients' connections
    # (each then waits a second for the retry).
    request_queue_size = 128

    def __init__(self, root: str, port: int = 0) -> None:
        super().__init__(("127.0.0.1", port), _Handler)
        self.root = root
        self.latency = 0.0
        self.fail_nth: Optional[int] = None
        self.fail_every: Optional[int] = None
        self.fail_mode = "midway"
        self.truncate = False
        self.status: Optional[int] = None
        self.ignore_range = False
        self.stall_after: Optional[int] = None
        self.overlong = 0
        self.shift = 0
        self.error_body = 0
        self.require_query: Optional[str] = None
        self.redirect_to: Optional[str] = None
        self.wrong_linked_etag = False
        self.busy, self.busy_for = 0, 1
        self._digests: Dict[Tuple[str, int, int], Tuple[str, str]] = {}  # file -> (sha256, git blob id)
        self.started: List[float] = []  # time.monotonic() as each request came in
        self.handshakes: Optional[int] = None  # TLS handshakes begun, once tls() was called
        self.released = threading.Event()  # set to let stalled responses go
        self.requests: List[Record] = []
        self.authorizations: List[Optional[str]] = []
        self.gets = 0
        self.lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None

    @property
    def url(self) -> str:
        if self.handshakes is not None:
            return f"https://localhost:{self.server_address[1]}"
        return f"http://127.0.0.1:{self.server_address[1]}"

    def tls(self, cert: str, key: str) -> "RangeServer":
        """Serves HTTPS (as ``localhost``) with the certificate ``cert``, counting handshakes."""
        import ssl

        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(cert, key)
        self.handshakes = 0

        def hello(*_: object) -> None:
            with self.lock:
                self.handshakes = (self.handshakes or 0) + 1

        ctx.sni_callback = hello
        self.socket = ctx.wrap_socket(self.socket, server_side=True)
        return self

    def start(self) -> "RangeServer":
        self._thread = threading.Thread(target=self.serve_forever, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self.released.set()
        self.shutdown()
        self.server_close()

    def reset(self) -> None:
        """Back to a well-behaved server with an empty log."""
        with self.lock:
            self.latency, self.fail_nth, self.fail_every, self.fail_mode = 0.0, None, None, "midway"
            self.truncate, self.status, self.ignore_range = False, None, False
            self.stall_after, self.overlong, self.error_body, self.require_query = None, 0, 0, None
            self.shift, self.wrong_linked_etag = 0, False
            self.redirect_to, self.busy, self.busy_for = None, 0, 1
            self.requests, self.gets, self.authorizations, self.started = [], 0, [], []
            self.released.set()
            self.released = threading.Event()

    def data_bytes_served(self, path: str) -> int:
        return sum(sent for method, p, _, _, sent in self.requests if method == "GET" and p == path)

    def hub_headers(self, url_path: str, path: str) -> Dict[str, str]:
        """What the Hub's answer to ``url_path`` says of the file it serves there (``path``), if
        it is a ``resolve`` URL of a file (see the module's docstring); else nothing."""
        if _RESOLVE.fullmatch(url_path) is None or not os.path.isfile(path):
            return {}
        stat = os.stat(path)
        key = (path, stat.st_size, stat.st_mtime_ns)
        if key not in self._digests:
            with open(path, "rb") as f:
                data = f.read()
            git = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
            self._digests[key] = (hashlib.sha256(data).hexdigest(), git)
        sha, git = self._digests[key]
        if not path.endswith(".safetensors"):
            return {"ETag": f'"{git}"'}
        if self.wrong_linked_etag:
            sha = hashlib.sha256(sha.encode()).hexdigest()
        return {"ETag": f'"{git}"', "X-Linked-Etag": f'"{sha}"', "X-Linked-Size": str(stat.st_size)}


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # Headers and body go out in separate writes: with Nagle's algorithm a small body waits for
    # the client's delayed ACK of the headers (40 ms a response on Linux).
    disable_nagle_algorithm = True
    server: RangeServer

    def log_message(self, *args: object) -> None:  # quiet
        pass

    def do_HEAD(self) -> None:
        self._serve(head=True)

    def do_GET(self) -> None:
        self._serve(head=False)

    def _serve(self, head: bool) -> None:
        srv = self.server
        with srv.lock:
            if not head:
                srv.gets += 1
            n = srv.gets
            fail = not head and (
                srv.fail_nth == n or (srv.fail_every is not None and n % srv.fail_every == 0))
            latency, status, truncate = srv.latency, srv.status, srv.truncate
            ignore_range, fail_mode = srv.ignore_range, srv.fail_mode
            stall_after, overlong, error_body, released = srv.stall_after, srv.overlong, srv.error_body, srv.released
            require_query, redirect_to = srv.require_query, srv.redirect_to
            srv.started.append(time.monotonic())
            busy = srv.busy > 0
            srv.busy -= busy
        if latency:
            threading.Event().wait(latency)
        method = "HEAD" if head else "GET"
        path = os.path.join(srv.root, self.path.lstrip("/").split("?")[0])
        wanted = _parse_range(self.headers.get("Range"))
        if busy:
            return self._answer(method, wanted, 503, b"slow down", {"Retry-After": str(srv.busy_for)})
        if status is not None or (fail and fail_mode == "status"):
            code = status if status is not None else 500
            body = f"injected {code}".encode() + b"x" * error_body
            return self._answer(method, wanted, code, body)
        # The Hub's API answers itself; its resolve URLs redirect to storage.
        tree = re.fullmatch(r"/api/(models|datasets|spaces)/([^/]+/[^/]+)/tree/([^/]+)/?(.*)",
                            self.path.split("?")[0])
        if tree is not None:
            return self._reply_tree(method, wanted, *tree.groups())
        hub = srv.hub_headers(self.path.split("?")[0], path)
        if redirect_to is not None:
            target = (srv.url if redirect_to == "self" else redirect_to) + self.path
            return self._answer(method, wanted, 302, b"", {**hub, "Location": target})
        if require_query is not None and self.path.partition("?")[2] != require_query:
            return self._answer(method, wanted, 403, b"signature does not match")
        if not os.path.isfile(path):
            return self._answer(method, wanted, 404, b"not found")
        size = os.path.getsize(path)
        stat = os.stat(path)
        etag = '"' + hashlib.md5(f"{stat.st_size}-{stat.st_mtime_ns}".encode()).hexdigest() + '"'
        asked = self.headers.get("If-Match")
        if asked is not None and asked != "*" and etag not in [t.strip() for t in asked.split(",")]:
            return self._answer(method, wanted, 412, b"precondition failed")  # the file changed since that ETag
        if wanted is not None and not ignore_range:
            begin, end = wanted[0], min(wanted[1], size - 1)
            if begin >= size:
                return self._answer(method, wanted, 416, b"range not satisfiable",
                                    {"Content-Range": f"bytes */{size}"})
            code, headers = 206, {"Content-Range": f"bytes {begin}-{end}/{size}"}
        else:
            begin, end, code, headers = 0, size - 1, 200, {}
        length = end - begin + 1
        extra = overlong if code == 206 else 0
        self.send_response(code)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(length + extra))
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("ETag", etag)
        for k, v in hub.items():
            if k != "ETag":  # the file's own ETag, which If-Match names
                self.send_header(k, v)
        self.send_header("Content-Type", "application/octet-stream")
        send = 0 if head else length // 2 if (truncate or fail) else length
        if stall_after is not None:
            send = min(send, stall_after)
        # Logged before the response goes out: a client that has it may look at the log at once.
        self._record(method, wanted, code, send)
        self.end_headers()
        if head:
            return
        shift = srv.shift if wanted is not None and begin > 0 else 0
        self._send_file(path, begin + shift, send, pad=shift > 0)
        if stall_after is not None:  # headers and a few bytes, then nothing
            self.wfile.flush()
            released.wait(120)
            self.close_connection = True
            return
        if extra:
            self.wfile.write(b"\0" * extra)
            return
        if send < length:  # cut the body off: the client sees a connection closed early
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_WR)
            self.close_connection = True

    def _send_file(self, path: str, begin: int, length: int, pad: bool = False) -> None:
        """``length`` bytes of the file from ``begin``; where it ends first, zeros (``pad``, a
        shifted range) or nothing more (the body is cut short)."""
        sent = 0
        with open(path, "rb") as f:
            f.seek(begin)
            while sent < length:
                block = f.read(min(1 << 20, length - sent))
                if not block and not pad:
                    break
                if not block:
                    block = b"\0" * min(1 << 20, length - sent)
                self.wfile.write(block)
                sent += len(block)

    def _reply_tree(self, method: str, wanted: Optional[Tuple[int, int]], kind: str, repo: str, revision: str,
                    folder: str) -> None:
        """The Hub API's listing of one folder of a repository (not recursive)."""
        from urllib.parse import unquote

        base = os.path.join(self.server.root, "" if kind == "models" else kind, repo, "resolve", unquote(revision),
                            folder)
        if not os.path.isdir(base):
            return self._answer(method, wanted, 404, b'{"error": "Entry not found"}')
        entries = []
        for name in sorted(os.listdir(base)):
            full, path = os.path.join(base, name), f"{folder}/{name}".lstrip("/")
            if os.path.isdir(full):
                entries.append({"type": "directory", "oid": "0", "size": 0, "path": path})
            else:
                entries.append({"type": "file", "oid": "0", "size": os.path.getsize(full), "path": path})
        self._answer(method, wanted, 200, json.dumps(entries).encode(), {"Content-Type": "application/json"})

    def _answer(self, method: str, wanted: Optional[Tuple[int, int]], code: int, body: bytes,
                headers: Optional[dict] = None) -> None:
        """A whole small response, logged before it goes out (as every response is), so a client
        that has it finds it in ``requests``. Bodies sent here count as no file bytes served."""
        self._record(method, wanted, code, 0)
        self._reply_empty(code, body, headers)

    def _reply_empty(self, code: int, body: bytes, headers: Optional[dict] = None) -> None:
        self.send_response(code)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _record(self, method: str, wanted: Optional[Tuple[int, int]], code: int, sent: int) -> None:
        with self.server.lock:
            self.server.requests.append((method, self.path, wanted, code, sent))
            self.server.authorizations.append(self.headers.get("Authorization"))


# A file's resolve URL under the Hub: [datasets/|spaces/]ORG/REPO/resolve/REVISION/PATH.
_RESOLVE = re.compile(r"/(?:(?:datasets|spaces)/)?[^/]+/[^/]+/resolve/[^/]+/.+")


def _parse_range(value: Optional[str]) -> Optional[Tuple[int, int]]:
    """``bytes=A-B`` (inclusive) or ``bytes=A-`` as (A, B); None when absent."""
    m = re.fullmatch(r"bytes=(\d+)-(\d*)", value.strip()) if value else None
    if not m:
        return None
    return int(m.group(1)), int(m.group(2)) if m.group(2) else (1 << 62)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("root")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--latency", type=float, default=0.0)
    args = p.parse_args()
    srv = RangeServer(args.root, args.port)
    srv.latency = args.latency
    print(srv.url, flush=True)
    srv.serve_forever()


if __name__ == "__main__":
    main()
