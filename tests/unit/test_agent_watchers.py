"""Preemption watchers against a tiny local HTTP server playing each cloud's metadata API."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from sailor.agent.watchers import GCP_NOTICE_S, AwsWatcher, AzureWatcher, FileWatcher, GcpWatcher
from sailor.coordination import ManualClock


class _Meta(BaseHTTPRequestHandler):
    preempted = False

    def log_message(self, *args: object) -> None:
        pass

    def _send(self, code: int, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_PUT(self) -> None:
        if self.path == "/latest/api/token" and self.headers.get(
            "X-aws-ec2-metadata-token-ttl-seconds"
        ):
            self._send(200, b"tok")
        else:
            self._send(403, b"")

    def do_GET(self) -> None:
        p = self.path
        if p == "/computeMetadata/v1/instance/preempted":
            ok = self.headers.get("Metadata-Flavor") == "Google"
            self._send(200 if ok else 403, b"TRUE" if self.preempted else b"FALSE")
        elif p == "/latest/meta-data/spot/instance-action":
            if self.headers.get("X-aws-ec2-metadata-token") != "tok":
                self._send(401, b"")
            elif self.preempted:
                self._send(
                    200,
                    json.dumps({"action": "terminate", "time": "2030-01-01T00:02:00Z"}).encode(),
                )
            else:
                self._send(404, b"")
        elif p.startswith("/metadata/scheduledevents") and self.headers.get("Metadata") == "true":
            events = (
                [{"EventType": "Preempt", "NotBefore": "Tue, 01 Jan 2030 00:00:30 GMT"}]
                if self.preempted
                else []
            )
            self._send(200, json.dumps({"DocumentIncarnation": 1, "Events": events}).encode())
        else:
            self._send(404, b"")


@pytest.fixture
def metadata() -> Iterator[tuple[str, type[_Meta]]]:
    handler = type("H", (_Meta,), {"preempted": False})
    srv = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}", handler
    srv.shutdown()
    srv.server_close()


async def test_cloud_watchers(metadata: tuple[str, type[_Meta]]) -> None:
    url, handler = metadata
    clock = ManualClock(1000.0)
    watchers = [GcpWatcher(url, clock), AwsWatcher(url, clock), AzureWatcher(url, clock)]
    for w in watchers:
        assert await w.check() is None, w.name
    handler.preempted = True
    got = {w.name: await w.check() for w in watchers}
    assert got["gcp"] is not None and got["gcp"].deadline == 1000.0 + GCP_NOTICE_S
    assert got["aws"] is not None and got["aws"].deadline == 1893456120.0
    assert got["azure"] is not None and got["azure"].deadline == 1893456030.0


async def test_unreachable_endpoint_is_no_notice() -> None:
    clock = ManualClock()
    assert await GcpWatcher("http://127.0.0.1:9", clock, timeout=0.5).check() is None


async def test_file_watcher(tmp_path: Path) -> None:
    clock = ManualClock(50.0)
    w = FileWatcher(tmp_path / "notice", clock)
    assert await w.check() is None
    (tmp_path / "notice").write_text(json.dumps({"in_s": 10}))
    n = await w.check()
    assert n is not None and n.deadline == 60.0 and n.source == "file"


@pytest.mark.parametrize(
    "body",
    ['{"deadline": "soon"}', "[1, 2]", '{"in_s": -5e400}', '{"in_s": true}', "{", "", "[" * 5000],
    ids=["text", "list", "-inf", "bool", "broken", "empty", "nested"],
)
async def test_a_malformed_notice_file_is_a_notice_at_the_default_deadline(
    tmp_path: Path, body: str
) -> None:
    """The file's appearance is the notice: a body without a usable time gives GCP's 30 s
    (a wrong field crashed the watcher until the agent exited; -5e400 gave a deadline of
    -inf that the notice refused, and the notice was lost)."""
    clock = ManualClock(50.0)
    (tmp_path / "notice").write_text(body)
    n = await FileWatcher(tmp_path / "notice", clock).check()
    assert n is not None and n.deadline == 50.0 + GCP_NOTICE_S, n
