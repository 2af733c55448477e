"""`ThreadedServer`: the real uvicorn server on 127.0.0.1 and a free port, in a background thread, for
tests and notebooks (`with ThreadedServer(ServerConfig(...)) as s: s.url`)."""
from __future__ import annotations

import socket
import threading
import time

import uvicorn

from deepinfer.server.app import ServerConfig, build_app


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ThreadedServer:
    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self._socket = None
        if config.port:
            self.port = config.port
        else:  # bound here and handed to uvicorn: a port probed free and bound later could be taken in between
            self._socket = socket.socket()
            self._socket.bind(("127.0.0.1", 0))
            self.port = self._socket.getsockname()[1]
        self.app = build_app(config)
        self._server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning",
                                                     timeout_graceful_shutdown=1))
        sockets = [self._socket] if self._socket is not None else None
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": sockets}, name="deepinfer-server",
                                        daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def engine(self):
        """The LLMEngine (read its block_pool only while the server is idle)."""
        return self.app.state.engine.engine

    def __enter__(self) -> ThreadedServer:
        self._thread.start()
        deadline = time.monotonic() + 60
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=30)
        if self._socket is not None:
            self._socket.close()
