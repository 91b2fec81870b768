"""benchmarks/agentic_run.py's client: one keep-alive connection per server, as an agent's SDK
holds, so a request's seconds are the server's and not the building of a client (~23 ms)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from benchmarks.agentic_run import Target, client_for, http_chat
from benchmarks.agentic_workloads import Turn


class _Chat(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as uvicorn and llama-server speak
    peers: list = []

    def do_POST(self):  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.peers.append(self.client_address)
        reply = json.dumps({"choices": [{"message": {"content": str(body["max_tokens"])}}],
                            "usage": {"completion_tokens": 1}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *args):
        pass


def test_turns_to_one_server_share_one_connection():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Chat)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    target = Target("none", f"http://127.0.0.1:{server.server_address[1]}", True)
    try:
        _Chat.peers = []
        bodies = [http_chat(target, "system", [{"role": "user", "content": "hi"}], Turn("hi"), n)
                  for n in (4, 5, 6)]
        assert [body["choices"][0]["message"]["content"] for body, _ in bodies] == ["4", "5", "6"]
        assert all(seconds > 0 for _, seconds in bodies)
        assert len(set(_Chat.peers)) == 1  # one connection, kept alive
        # The control: a new client per request (what `httpx.post` does) opens one each.
        _Chat.peers = []
        for n in (4, 5, 6):
            client_for.cache_clear()
            http_chat(target, None, [{"role": "user", "content": "hi"}], Turn("hi"), n)
        assert len(set(_Chat.peers)) == 3
    finally:
        client_for.cache_clear()
        server.shutdown()
