"""The live view: a read-only web page and JSON API served by the coordinator process.

``fusion-coordinator --http HOST:PORT`` serves, next to the gRPC service:

- ``GET /``: one static page (``live_view.html``) that polls the API every second;
- ``GET /api/jobs``, ``GET /api/jobs/ID[?after=SEQ]``, ``GET /api/workers``,
  ``GET /api/links``: the documents of :mod:`fusion.coordinator.live_documents`;
- ``POST /login``: a form posting the coordinator's token; the answer sets an
  ``HttpOnly``, ``SameSite=Strict`` cookie derived from it (not the token itself).

Every request must carry the coordinator's token (``Authorization: Bearer TOKEN``) or
that cookie; without one the answer is 401 (the login form, for a page). Credentials are
compared in constant time, and wrong ones count against the same per-address budget as
the gRPC service's (past it: 429, a valid credential is still served). Nothing here
changes state: any other method is refused with 405. With a certificate the server speaks
only TLS, the handshake made on the connection's own thread (a client that stalls holds
only that thread, until its timeout). A request that fails answers 4xx/5xx; the server
keeps serving.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import secrets
import socket
import ssl
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from fusion.auth import peer_host
from fusion.coordinator import live_documents as docs
from fusion.coordinator.service import CoordinatorService
from fusion.errors import NotFoundError

logger = logging.getLogger(__name__)

PAGE = Path(__file__).with_name("live_view.html")
COOKIE = "fusion_view"
#: Largest login form body read.
MAX_FORM_BYTES = 4096
#: Seconds a connection may stay silent (also bounds the TLS handshake).
CONNECTION_TIMEOUT_S = 30.0
#: Most connections served at once; more are closed at once (each holds a thread).
MAX_CONNECTIONS = 64
LOGIN_FORM = """<!doctype html><html><head><meta charset="utf-8"><title>fusion live view: sign in</title>
<style>body{{font:15px system-ui,sans-serif;margin:4em auto;max-width:28em}}input{{font:inherit}}</style></head>
<body><h1>fusion live view</h1><p>{message}</p><form method="post" action="/login">
<label>Coordinator token <input type="password" name="token" autofocus required></label>
<button type="submit">Sign in</button></form></body></html>"""


class LiveViewServer(ThreadingHTTPServer):
    """The HTTP(S) server; :meth:`close` stops it and its thread."""

    daemon_threads = True

    def __init__(
        self, address: tuple[str, int], service: CoordinatorService, token: str, tls: ssl.SSLContext | None
    ) -> None:
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        super().__init__(address, LiveViewHandler)
        self.service = service
        self.token = token.encode()
        self.cookie_value = hmac.new(self.token, b"fusion live view cookie", hashlib.sha256).hexdigest()
        self.tls = tls is not None
        if tls is not None:
            self.socket = tls.wrap_socket(self.socket, server_side=True, do_handshake_on_connect=False)
        self._thread = threading.Thread(
            target=self.serve_forever, kwargs={"poll_interval": 0.2}, name="live-view", daemon=True
        )
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)

    @property
    def port(self) -> int:
        return int(self.server_address[1])

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        """Stop serving and release the port."""
        if self._thread.is_alive():
            self.shutdown()
            self._thread.join(timeout=10)
        self.server_close()

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            logger.debug("live view: %d connections open; closing the one from %s", MAX_CONNECTIONS, client_address)
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        logger.debug("live view: connection from %s failed", client_address, exc_info=True)


class LiveViewHandler(BaseHTTPRequestHandler):
    """One connection's requests."""

    server: LiveViewServer
    protocol_version = "HTTP/1.1"
    timeout = CONNECTION_TIMEOUT_S

    def setup(self) -> None:
        self.request.settimeout(self.timeout)
        if isinstance(self.request, ssl.SSLSocket):
            self.request.do_handshake()
        super().setup()

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base class's name)
        logger.debug("live view %s: " + format, self.address_string(), *args)

    # ------------------------------------------------------------- auth
    def _credential_state(self) -> str:
        """``ok``, ``missing`` or ``wrong``."""
        header = self.headers.get("Authorization")
        if header is not None:
            scheme, _, value = header.partition(" ")
            if scheme.lower() == "bearer" and hmac.compare_digest(_bytes(value.strip()), self.server.token):
                return "ok"
            return "wrong"
        cookies = _cookies(self.headers.get("Cookie", ""))
        if COOKIE in cookies:
            return "ok" if hmac.compare_digest(_bytes(cookies[COOKIE]), self.server.cookie_value.encode()) else "wrong"
        return "missing"

    def _over_budget(self) -> bool:
        """Count a wrong credential against this address; true (and 429 sent) past its budget."""
        host = self.client_address[0]
        source = peer_host(f"ipv6:[{host}]:0" if ":" in host else f"ipv4:{host}:0")
        if self.server.service.auth_failures.allow(source):
            return False
        self._json(429, {"error": "too many failed authentications from this address; retry later"})
        return True

    def _refuse(self, state: str, *, page: bool) -> None:
        """401 (429 past the address's failure budget) for a request without a valid credential."""
        if state == "wrong" and self._over_budget():
            return
        if page:
            self._html(401, LOGIN_FORM.format(message="Sign in with the coordinator's token."))
        else:
            self._json(401, {"error": "wrong or missing token: send Authorization: Bearer TOKEN, or sign in at /"})

    # ------------------------------------------------------------- methods
    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        self._safely(self._get)

    def do_POST(self) -> None:  # noqa: N802
        self._safely(self._post)

    def _refuse_method(self) -> None:
        self.close_connection = True
        self._json(405, {"error": f"{self.command} is not served: the live view is read-only"}, allow="GET, POST")

    do_PUT = do_DELETE = do_PATCH = do_HEAD = do_OPTIONS = _refuse_method  # noqa: N815

    def _safely(self, handle: Any) -> None:
        try:
            handle()
        except NotFoundError as e:
            self._json(404, {"error": str(e)})
        except (ConnectionError, TimeoutError):
            self.close_connection = True
        except Exception:
            logger.exception("live view: %s %s failed", self.command, self.path)
            self.close_connection = True
            self._json(500, {"error": "internal error; see the coordinator's log"})

    def _get(self) -> None:
        url = urlsplit(self.path)
        path = url.path.rstrip("/") or "/"
        state = self._credential_state()
        if state != "ok":
            self._refuse(state, page=not path.startswith("/api"))
            return
        service = self.server.service
        if path in ("/", "/index.html"):
            self._html(200, PAGE.read_text(encoding="utf-8"))
        elif path == "/api/jobs":
            self._json(200, docs.jobs_document(service))
        elif path.startswith("/api/jobs/") and path.count("/") == 3:
            after = parse_qs(url.query).get("after", ["0"])[0]
            if not after.isdigit():
                self._json(400, {"error": f"after must be a log position (a whole number), got {after!r}"})
                return
            self._json(200, docs.job_document(service, path.rsplit("/", 1)[1], after_seq=int(after)))
        elif path == "/api/workers":
            self._json(200, docs.workers_document(service))
        elif path == "/api/links":
            self._json(200, docs.links_document(service))
        else:
            self._json(404, {"error": f"no such page: {url.path}"})

    def _post(self) -> None:
        if urlsplit(self.path).path != "/login":
            self._refuse_method()
            return
        length = self.headers.get("Content-Length", "")
        if not length.isdigit() or int(length) > MAX_FORM_BYTES:
            self.close_connection = True
            self._json(400, {"error": f"a login form needs a Content-Length of at most {MAX_FORM_BYTES} bytes"})
            return
        form = parse_qs(self.rfile.read(int(length)).decode("utf-8", "replace"))
        token = form.get("token", [""])[0]
        if not hmac.compare_digest(_bytes(token), self.server.token):
            if self._over_budget():
                return
            self._html(401, LOGIN_FORM.format(message="Wrong token; try again."))
            return
        secure = "; Secure" if self.server.tls else ""
        cookie = f"{COOKIE}={self.server.cookie_value}; HttpOnly; SameSite=Strict; Path=/{secure}"
        self._send(303, b"", "text/plain", {"Location": "/", "Set-Cookie": cookie})

    # ------------------------------------------------------------- answers
    def _json(self, code: int, body: Any, *, allow: str | None = None) -> None:
        headers = {"Allow": allow} if allow else {}
        self._send(code, json.dumps(body).encode(), "application/json", headers)

    def _html(self, code: int, text: str) -> None:
        nonce = secrets.token_urlsafe(16)
        csp = (
            f"default-src 'none'; script-src 'nonce-{nonce}'; style-src 'unsafe-inline'; connect-src 'self'; "
            "img-src data:; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
        )
        body = text.replace("{{NONCE}}", nonce).encode()
        self._send(code, body, "text/html; charset=utf-8", {"Content-Security-Policy": csp})

    def _send(self, code: int, body: bytes, content_type: str, headers: dict[str, str]) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Referrer-Policy", "no-referrer")
        for key, value in headers.items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(body)


def _bytes(text: str) -> bytes:
    return text.encode("utf-8", "replace")


def _cookies(header: str) -> dict[str, str]:
    out = {}
    for part in header.split(";"):
        key, sep, value = part.strip().partition("=")
        if sep:
            out[key] = value
    return out


def tls_context(cert: str | Path, key: str | Path) -> ssl.SSLContext:
    """A server TLS context (TLS 1.2 or newer) from a PEM certificate chain and key."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(str(cert), str(key))
    return ctx


def start_live_view(
    service: CoordinatorService, host: str, port: int, *, token: str, tls: ssl.SSLContext | None = None
) -> LiveViewServer:
    """Serve the live view of ``service`` on ``host:port`` (0: a free port) in a daemon thread.

    Only requests carrying ``token`` (the coordinator's) are answered. ``OSError`` when the
    address cannot be bound."""
    server = LiveViewServer((host, port), service, token, tls)
    server.start()
    logger.info("live view on %s://%s:%d/", "https" if tls else "http", host, server.port)
    return server
