"""An HTTP proxy on loopback, as corporate proxies answer: ``CONNECT host:port`` opens a tunnel
(for https hosts; TLS runs end to end inside it) and an absolute-form request (``GET
http://host/path``) is forwarded to the host, its response streamed back. With ``credentials``
("user:password") set, a request without that ``Proxy-Authorization`` is answered ``407``.

``requests`` records (method, target, Proxy-Authorization or None) for each request it gets.

    python tests/support/proxy_server.py [--port 0]
"""

from __future__ import annotations

import argparse
import base64
import http.client
import select
import socket
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import List, Optional, Tuple

#: Hop-by-hop headers (RFC 9110, 7.6.1): the proxy's own, never passed on.
HOP = {"connection", "keep-alive", "proxy-authorization", "proxy-connection", "te", "trailer",
       "transfer-encoding", "upgrade"}


class ProxyServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, port: int = 0) -> None:
        super().__init__(("127.0.0.1", port), _Handler)
        self.credentials: Optional[str] = None
        self.requests: List[Tuple[str, str, Optional[str]]] = []
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def start(self) -> "ProxyServer":
        threading.Thread(target=self.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        self.shutdown()
        self.server_close()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True
    server: ProxyServer

    def log_message(self, *args: object) -> None:  # quiet
        pass

    def _admitted(self) -> bool:
        auth = self.headers.get("Proxy-Authorization")
        with self.server.lock:
            self.server.requests.append((self.command, self.path, auth))
            wanted = self.server.credentials
        if wanted is None or auth == "Basic " + base64.b64encode(wanted.encode()).decode():
            return True
        self.send_response(407)
        self.send_header("Proxy-Authenticate", 'Basic realm="proxy"')
        self.send_header("Content-Length", "0")
        self.end_headers()
        return False

    def do_CONNECT(self) -> None:
        if not self._admitted():
            return
        host, _, port = self.path.rpartition(":")
        try:
            upstream = socket.create_connection((host, int(port)), timeout=30)
        except OSError:
            self.send_error(502)
            return
        self.send_response(200, "Connection established")
        self.end_headers()
        self.close_connection = True
        ends = [self.connection, upstream]
        try:
            while True:
                ready, _, _ = select.select(ends, [], [], 60)
                if not ready:
                    return
                for end in ready:
                    data = end.recv(1 << 16)
                    if not data:
                        return
                    (upstream if end is self.connection else self.connection).sendall(data)
        except OSError:
            return
        finally:
            upstream.close()

    def _forward(self) -> None:
        if not self._admitted():
            return
        target = urllib.parse.urlsplit(self.path)
        if target.scheme != "http" or not target.hostname:
            self.send_error(400, "absolute http:// URI expected")
            return
        upstream = http.client.HTTPConnection(target.hostname, target.port or 80, timeout=30)
        try:
            path = target.path + (f"?{target.query}" if target.query else "")
            headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP}
            upstream.request(self.command, path or "/", headers=headers)
            response = upstream.getresponse()
            self.send_response(response.status, response.reason)
            for k, v in response.getheaders():
                if k.lower() not in HOP:
                    self.send_header(k, v)
            if response.getheader("Content-Length") is None:  # the body ends with the connection
                self.send_header("Connection", "close")
                self.close_connection = True
            self.end_headers()
            if self.command != "HEAD":
                while chunk := response.read(1 << 16):
                    self.wfile.write(chunk)
        except OSError:
            self.close_connection = True
        finally:
            upstream.close()

    do_GET = _forward
    do_HEAD = _forward


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--port", type=int, default=0)
    args = p.parse_args()
    server = ProxyServer(args.port)
    print(server.url, flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
