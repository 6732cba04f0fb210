"""A TCP proxy in front of a server that can be cut: while cut, every connection it holds is
closed and new ones are refused at once (the server "errors"); the server behind it keeps its
state, so what a client wrote before the cut is still there after it."""

from __future__ import annotations

import contextlib
import socket
import threading


class CuttableProxy:
    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.cut = threading.Event()
        self._open: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return  # closed
            if self.cut.is_set():
                client.close()
                continue
            upstream = socket.create_connection(self.target)
            with self._lock:
                self._open += [client, upstream]
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while not self.cut.is_set():
                data = source.recv(65536)
                if not data:
                    break
                sink.sendall(data)
        for end in (source, sink):
            with contextlib.suppress(OSError):
                end.shutdown(socket.SHUT_RDWR)

    def sever(self) -> None:
        """Cut: the connections held are closed, new ones refused until `mend`."""
        self.cut.set()
        with self._lock:
            held, self._open = self._open, []
        for end in held:
            with contextlib.suppress(OSError):
                end.shutdown(socket.SHUT_RDWR)

    def mend(self) -> None:
        self.cut.clear()

    def close(self) -> None:
        self.sever()
        self.listener.close()
