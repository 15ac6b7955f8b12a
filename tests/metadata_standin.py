"""A stand-in for the EC2 instance metadata service on the loopback, answering what AWS documents (and only that).

- ``PUT /latest/api/token`` with ``X-aws-ec2-metadata-token-ttl-seconds`` (1-21600) answers a token as plain text; a
  missing or bad TTL is 400 (AWS EC2 user guide, "Use IMDSv2", and its "Instance metadata service error codes").
- Every ``GET`` needs ``X-aws-ec2-metadata-token`` with a token it issued, else 401 (same pages).
- ``GET /latest/meta-data/spot/instance-action``: 404 until a notice is set, then ``{"action": ..., "time": ...}``
  ("Spot Instance interruption notices"); ``GET /latest/meta-data/events/recommendations/rebalance``: 404, then
  ``{"noticeTime": ...}`` ("EC2 instance rebalance recommendations").

``notice_after`` serves the notice only from that many instance-action requests on (a notice that comes mid-run).
Example::

    with MetadataStandIn() as imds:
        imds.action = {"action": "terminate", "time": "2026-12-07T22:40:00Z"}
        os.environ["AWS_EC2_METADATA_SERVICE_ENDPOINT"] = imds.url
"""

from __future__ import annotations

import json
import secrets
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

ACTION = "/latest/meta-data/spot/instance-action"
REBALANCE = "/latest/meta-data/events/recommendations/rebalance"


class MetadataStandIn:
    def __init__(self, *, notice_after: int = 0) -> None:
        self.action: dict[str, str] | None = None
        self.rebalance: dict[str, str] | None = None
        self.notice_after = notice_after
        self.requests: list[tuple[str, str, int]] = []  # (method, path, status answered)
        self.expire_next = False  # the next GET answers 401, as after the token's TTL
        self._tokens: set[str] = set()
        self._server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def count(self, path: str) -> int:
        return sum(1 for _, p, _ in self.requests if p == path)

    def __enter__(self) -> MetadataStandIn:
        standin = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *_: Any) -> None:
                pass

            def _answer(self, status: int, body: str = "", kind: str = "text/plain") -> None:
                standin.requests.append((self.command, self.path, status))
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body.encode())

            def do_PUT(self) -> None:
                if self.path != "/latest/api/token":
                    return self._answer(404)
                ttl = self.headers.get("X-aws-ec2-metadata-token-ttl-seconds", "")
                if not ttl.isdigit() or not 1 <= int(ttl) <= 21600:
                    return self._answer(400)
                token = secrets.token_urlsafe(16)
                standin._tokens.add(token)
                return self._answer(200, token)

            def do_GET(self) -> None:
                if self.headers.get("X-aws-ec2-metadata-token") not in standin._tokens or standin.expire_next:
                    standin.expire_next = False
                    standin._tokens.clear()
                    return self._answer(401)
                body = None
                if self.path == ACTION and standin.count(ACTION) >= standin.notice_after:
                    body = standin.action
                elif self.path == REBALANCE:
                    body = standin.rebalance
                if body is None:
                    return self._answer(404)
                return self._answer(200, json.dumps(body), "application/json")

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self._server.serve_forever, args=(0.05,), name="imds-standin", daemon=True).start()
        return self

    def __exit__(self, *_: Any) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
