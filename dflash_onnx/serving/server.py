"""`dflash-onnx serve`'s process around the app: its listening socket, bound before anything claims to be serving
(a taken port is refused in one line), uvicorn on that socket without its own access log, and a shutdown on
SIGTERM or Ctrl-C that lets the requests under way finish for a grace period, then cancels the rest (a stream
ends with an error event and [DONE], a whole completion with 503), stops the engine and says so in one line; exit
0. A second signal cancels at once."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import signal
import socket
import threading
import time
from collections import Counter

import uvicorn

from dflash_onnx.runtime.errors import DFlashError
from dflash_onnx.serving.app import InFlight
from dflash_onnx.serving.engine import Engine, Submission

SIGNALS = (signal.SIGINT, signal.SIGTERM)
DRAIN_POLL_S = 0.05  # how often a shutdown looks whether the requests under way have ended
BACKSTOP_S = 30.0  # after the grace, how long cancelled requests may take to end before uvicorn drops them
FORCED_S = 5.0  # after a second signal, how long cancelled requests may take to end their responses


def listen(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port and listening (port 0: a free one), or one line saying why it cannot be."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET  # as uvicorn reads --host
    try:
        address = socket.getaddrinfo(host, port, family, socket.SOCK_STREAM, 0, socket.AI_PASSIVE)[0][4]
    except socket.gaierror as exc:
        raise DFlashError(f"cannot listen on --host {host}: {exc.strerror} (give an address of this machine, "
                          "e.g. 127.0.0.1 or 0.0.0.0)") from None
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: a port in TIME_WAIT is free
        sock.bind(address)
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        where = f"{host}:{port}" if family == socket.AF_INET else f"[{host}]:{port}"
        why = {errno.EADDRINUSE: f"cannot listen on {where}: the port is taken by another process; choose another "
                                 "--port (0: a free one)",
               errno.EADDRNOTAVAIL: f"{host} is not an address of this machine: choose another --host",
               errno.EACCES: f"port {port} needs privileges on this machine: choose a --port above 1023"}
        raise DFlashError(why.get(exc.errno, f"cannot listen on {where}: {exc.strerror}")) from None
    return sock


def url(sock: socket.socket) -> str:
    """http://host:port of a listening socket (the port it got where --port 0 asked for any)."""
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if sock.family == socket.AF_INET6 else f"http://{host}:{port}"


class _Server(uvicorn.Server):
    """uvicorn's server with this shutdown: new requests get 503 at once, those under way get `grace` seconds,
    then are cancelled; the signal that asked for it is not raised again afterwards (uvicorn re-raises it, which
    ends the process by SIGTERM's default or as a KeyboardInterrupt), so the process exits 0 once it has shut
    down."""

    def __init__(self, config: uvicorn.Config, in_flight: InFlight, engine: Engine, grace: float):
        super().__init__(config)
        self.in_flight, self.engine, self.grace = in_flight, engine, grace
        self.signal_name: str | None = None
        self.under_way: list[Submission] = []  # the requests under way when the shutdown began
        self.cancelled_after_grace = 0

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {sig: signal.signal(sig, self.handle_exit) for sig in SIGNALS}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame) -> None:
        if self.should_exit:  # a second signal: cancel what is under way now
            self.force_exit = True
        self.should_exit = True
        if self.signal_name is None:
            self.signal_name = signal.Signals(sig).name

    async def shutdown(self, sockets=None) -> None:
        self.in_flight.draining = True  # from here new requests get 503
        self.under_way = self.in_flight.under_way()
        drain = asyncio.ensure_future(self._drain())
        try:
            await super().shutdown(sockets)  # returns at once on a second signal
            if self.force_exit:  # then what it cancelled may end its responses, for a moment at most
                self._cancel()
                deadline = time.monotonic() + FORCED_S
                while self.server_state.connections and time.monotonic() < deadline:
                    await asyncio.sleep(DRAIN_POLL_S)
                await self.lifespan.shutdown()  # which uvicorn skips then: its task cancelled logs a traceback
        finally:
            drain.cancel()

    async def _drain(self) -> None:
        """Wait up to the grace for the requests under way to end, then cancel those left: each ends at its next
        step, its handler ending its response in the OpenAI error shape."""
        deadline = time.monotonic() + self.grace
        while len(self.in_flight) and not self.force_exit and time.monotonic() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
        self._cancel()

    def _cancel(self) -> None:
        if not self.cancelled_after_grace:
            self.cancelled_after_grace = self.in_flight.cancel()

    def summary(self) -> str:
        """The shutdown's one line."""
        why = f"on {self.signal_name}" if self.signal_name else "as asked"
        engine = "the engine stopped" if self.engine.stopped else "the engine thread did not stop within 60 s"
        if not self.under_way:
            return f"dflash-onnx serve: shut down {why}: no request was under way; {engine}"
        ended = Counter(submission.outcome for submission in self.under_way)
        parts = [f"{ended['stop'] + ended['length']} finished", f"{ended['cancelled']} cancelled"]
        if self.cancelled_after_grace:
            when = "on a second signal" if self.force_exit else f"at the end of the {self.grace:g} s grace"
            parts[1] += f" ({self.cancelled_after_grace} {when})"
        parts += [f"{ended[key]} {word}" for key, word in (("error", "failed"), (None, "left unended")) if ended[key]]
        count = len(self.under_way)
        under_way = f"{count} request{'s' if count != 1 else ''} under way"
        return f"dflash-onnx serve: shut down {why}: {under_way}, {', '.join(parts)}; {engine}"


def run(app, sock: socket.socket, engine: Engine, grace: float) -> str:
    """Serve `app` (create_app's, over `engine`) on `sock` until SIGTERM or Ctrl-C; then shut down as the module
    says, close the engine and return the line saying what was finished and what cancelled."""
    if grace < 0:
        raise DFlashError(f"--shutdown-grace must be at least 0, got {grace:g}")
    config = uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=grace + BACKSTOP_S)
    server = _Server(config, app.state.in_flight, engine, grace)
    try:
        server.run(sockets=[sock])
    finally:
        engine.close()
    return server.summary()
