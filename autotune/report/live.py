"""The live view: optuna-dashboard on the study's storage while a run goes on, served on
127.0.0.1 only, read-only unless asked, behind a Host check; and the small WSGI server that
stops cleanly on Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterable
from types import FrameType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from wsgiref.types import StartResponse, WSGIApplication, WSGIEnvironment

READ_METHODS = ("GET", "HEAD")


def serve_live(storage_url: str, port: int, on_ready: Callable[[str], None],
               writable: bool = False) -> None:
    """optuna-dashboard on the storage, bound to 127.0.0.1 (``port`` 0: a free one), until
    Ctrl-C or SIGTERM. ``on_ready(url)`` is called once it listens. Read-only unless
    ``writable``; requests naming another Host are refused (``guard``)."""
    import optuna_dashboard

    from autotune.tuner.storage import open_existing

    bound: list[int] = []
    app = guard(optuna_dashboard.wsgi(open_existing(storage_url)), bound, writable)

    def ready(port: int) -> None:
        bound.append(port)
        on_ready(f"http://127.0.0.1:{port}/dashboard/")

    serve(app, port, ready)


def guard(app: WSGIApplication, bound: list[int], writable: bool) -> WSGIApplication:
    """The live view's WSGI app behind two checks: the Host header must name this server
    (127.0.0.1 or localhost at the bound port), so a page elsewhere cannot reach it through DNS
    rebinding; and only reads pass unless ``writable`` (optuna-dashboard can delete studies and
    edit notes)."""
    def guarded(environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        port = bound[0] if bound else None
        host = str(environ.get("HTTP_HOST", "")).lower()
        allowed = {f"127.0.0.1:{port}", f"localhost:{port}"}
        if host not in allowed:
            return _refuse(start_response, "403 Forbidden",
                           f"Host {host!r} is not this server; open http://127.0.0.1:{port}/")
        if not writable and environ.get("REQUEST_METHOD", "GET") not in READ_METHODS:
            return _refuse(start_response, "405 Method Not Allowed",
                           "the live dashboard is read-only; start it with --writable to edit "
                           "or delete studies")
        return app(environ, start_response)

    return guarded


def _refuse(start_response: StartResponse, status: str, why: str) -> list[bytes]:
    body = (why + "\n").encode()
    start_response(status, [("Content-Type", "text/plain; charset=utf-8"),
                            ("Content-Length", str(len(body)))])
    return [body]


def serve(app: WSGIApplication, port: int, on_ready: Callable[[int], None]) -> None:
    """Serve the WSGI ``app`` on 127.0.0.1 until Ctrl-C or SIGTERM, then return.

    The signals stop the server from a thread of their own instead of raising in the main
    thread: wsgiref's request handler catches every exception, KeyboardInterrupt included, so
    a signal that lands while a request is being answered would be swallowed and the server
    would go on serving."""
    from wsgiref.simple_server import WSGIRequestHandler, make_server

    class Quiet(WSGIRequestHandler):
        def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base's
            pass

    with make_server("127.0.0.1", port, app, handler_class=Quiet) as server:
        def stop(signum: int, frame: FrameType | None) -> None:
            threading.Thread(target=server.shutdown, daemon=True).start()

        previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            on_ready(server.server_port)
            server.serve_forever()
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
