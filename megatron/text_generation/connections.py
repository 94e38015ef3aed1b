"""A threading HTTP server that serves at most N connections at once and answers the rest 503.

Each served connection holds a *slot* and its own thread. A connection over the bound is
answered ``503`` at once by one shared thread (:class:`Refuser`), which then reads and drops
whatever the client still sends, for a short while, before closing: closing a socket with unread
data sends a reset, which can make the client lose the 503 it has not read yet.

A connection gives its slot back when its thread ends, or earlier, just before its last answer
is written (:meth:`BoundedHTTPServer.release_slot`): a client that reads an answer and connects
again at once must find the slot free, or a lone sequential client would meet 503s.
"""

import json
import queue
import selectors
import socket
import sys
import threading
import time
from http.server import ThreadingHTTPServer
from typing import Dict


def busy_response(max_connections: int) -> bytes:
    """The whole 503 answer, JSON like every other answer of the server."""
    message = (f"the server is serving its maximum of {max_connections} connections "
               f"(--max-connections); retry later")
    body = json.dumps({"error": message, "message": message}).encode()
    head = (f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nRetry-After: 1\r\nConnection: close\r\n\r\n")
    return head.encode() + body


class Refuser:
    """One thread answering refused connections: ``refuse(sock)`` sends the 503 at once; the
    thread drains each socket until the client closes it or ``drain_s`` passes, then closes it.
    At most ``max_sockets`` are drained at once; beyond that a socket is closed right after its
    503 is sent."""

    def __init__(self, response: bytes, drain_s: float = 2.0, max_sockets: int = 256):
        self.response = response
        self.drain_s = drain_s
        self.max_sockets = max_sockets
        self._incoming: "queue.SimpleQueue[socket.socket]" = queue.SimpleQueue()
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._deadlines: Dict[socket.socket, float] = {}
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="refuser", daemon=True)
        self._thread.start()

    def refuse(self, sock: socket.socket) -> None:
        """Answer ``sock`` 503 now (the answer fits any socket buffer) and hand it over."""
        try:
            sock.setblocking(False)
            sock.send(self.response)
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            sock.close()
            return
        self._incoming.put(sock)
        self._wake()

    def close(self) -> None:
        """Stop the thread and close every socket it holds."""
        self._stopping = True
        self._wake()
        self._thread.join()
        self._selector.close()
        self._wake_r.close()
        self._wake_w.close()

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"\0")
        except OSError:
            pass  # already awake: its buffer is full of wake-ups

    def _take_incoming(self) -> None:
        while True:
            try:
                sock = self._incoming.get_nowait()
            except queue.Empty:
                return
            if len(self._deadlines) >= self.max_sockets:
                sock.close()
                continue
            self._deadlines[sock] = time.monotonic() + self.drain_s
            self._selector.register(sock, selectors.EVENT_READ)

    def _drop(self, sock: socket.socket) -> None:
        self._selector.unregister(sock)
        del self._deadlines[sock]
        sock.close()

    def _loop(self) -> None:
        while not self._stopping:
            self._take_incoming()
            timeout = None
            if self._deadlines:
                timeout = max(0.0, min(self._deadlines.values()) - time.monotonic())
            for key, _ in self._selector.select(timeout):
                sock = key.fileobj
                if sock is self._wake_r:
                    while True:
                        try:
                            if not self._wake_r.recv(4096):
                                break
                        except BlockingIOError:
                            break
                    continue
                try:
                    data = sock.recv(65536)
                except BlockingIOError:
                    continue
                except OSError:
                    data = b""
                if not data:
                    self._drop(sock)
            now = time.monotonic()
            for sock in [s for s, deadline in self._deadlines.items() if deadline <= now]:
                self._drop(sock)
        self._take_incoming()
        for sock in list(self._deadlines):
            self._drop(sock)


class BoundedHTTPServer(ThreadingHTTPServer):
    """A thread per connection, at most ``max_connections`` of them; see the module docstring."""

    daemon_threads = True
    # Stopping must not wait for connections still inside their read timeout.
    block_on_close = False
    # socketserver's listen backlog is 5: a burst of connections beyond it waits for the
    # client's SYN retransmission (a second or more) instead of being answered, 503 included.
    request_queue_size = 128

    def __init__(self, address, handler, max_connections: int):
        self.max_connections = max_connections
        self._slots = threading.BoundedSemaphore(max_connections)
        self._holders = set()
        self._holders_lock = threading.Lock()
        super().__init__(address, handler)
        self._refuser = Refuser(busy_response(max_connections))

    def process_request(self, request, client_address):
        if not self._slots.acquire(blocking=False):
            sys.stderr.write(f"{client_address[0]} - 503: {self.max_connections} connections "
                             f"busy (--max-connections)\n")
            self._refuser.refuse(request)
            return
        with self._holders_lock:
            self._holders.add(request)
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.release_slot(request)
            raise

    def release_slot(self, request) -> None:
        """Give back the slot of connection ``request`` (once; later calls do nothing)."""
        with self._holders_lock:
            if request not in self._holders:
                return
            self._holders.remove(request)
        self._slots.release()

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.release_slot(request)

    def server_close(self):
        super().server_close()
        self._refuser.close()

    def handle_error(self, request, client_address):
        if isinstance(sys.exc_info()[1], OSError):  # a client that went away mid-answer
            sys.stderr.write(f"{client_address[0]} - connection lost: {sys.exc_info()[1]}\n")
            return
        super().handle_error(request, client_address)
