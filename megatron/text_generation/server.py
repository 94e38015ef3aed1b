"""Megatron's REST generation server on the standard library: ``PUT /api`` and the
OpenAI-style ``POST /completions`` (:mod:`~megatron.text_generation.completions`) on rank 0.

Rank 0 answers HTTP; every other rank of the job waits in :meth:`GenerationService.worker_loop`.
For each valid request rank 0 broadcasts a *generate* signal and the request's payload to all
ranks (Megatron's scheme), and all of them run the generation together: tensor-parallel ranks
split each layer, pipeline stages pass activations forward. A lock lets one generation run at a
time; requests arriving meanwhile wait for it. A request that fails validation is answered
``400 {"error": message}`` (``413`` when too large) by rank 0 alone, before any other rank is
involved, and the server keeps serving.

An error inside a generation never ends a rank: every rank catches it, and after each generation
all ranks agree on the worst outcome with one all-reduce, so rank 0 answers 400 (the request
cannot be generated, e.g. its temperature makes the distribution overflow; raised at the same
step on every rank, see ``generation``) or 500 (anything else, logged with its traceback on the
rank that met it), and every rank is ready for the next request. An error raised on one rank
alone *between* two of the model's collectives would leave the others waiting in it until the
process group's timeout; every rank runs the same payload, so the errors a request can cause are
met on all of them at the same point.

HTTP: rank 0 listens on ``--host`` (default 127.0.0.1: this machine only; there is no
authentication, so exposing it is the operator's choice). Each request must arrive, headers and
body, within ``--read-timeout`` seconds of its first byte being awaited (idle keep-alive
connections too), or the connection is closed (``408`` when the headers had arrived). At most
``--max-connections`` connections are served at once, each on its own thread; one more is
answered ``503`` at once and closed (``connections``).

Waiting ranks sit in a broadcast; a collective waits at most the process group's timeout
(``--distributed-timeout-minutes``), so while idle rank 0 broadcasts a *heartbeat* signal well
within it.
"""

import ipaddress
import json
import socket
import sys
import threading
import time
import traceback
from http.server import BaseHTTPRequestHandler
from typing import Callable, Optional
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from megatron.text_generation import api, completions
from megatron.text_generation.connections import BoundedHTTPServer
from megatron.text_generation.generation import GenerationError

GENERATE_NUM = 0
SHUTDOWN_NUM = 2
HEARTBEAT_NUM = 3
API_PATH = "/api"
COMPLETIONS_PATHS = ("/completions", "/v1/completions")
MAX_BODY_BYTES = 16 * 1024 * 1024
DEFAULT_HOST = "127.0.0.1"
DEFAULT_READ_TIMEOUT_S = 30.0
DEFAULT_MAX_CONNECTIONS = 16
# Outcomes of one generation, ordered: the ranks agree on the largest.
OK, BAD_REQUEST, FAILED = 0, 1, 2


class GenerationFailed(RuntimeError):
    """A generation raised something other than :class:`GenerationError` on some rank (HTTP
    500); the traceback is in that rank's log."""


class GenerationService:
    """Runs requests on every rank of the job.

    Args:
        model: this rank's model chunk (eval mode).
        pstate: this rank's parallel state.
        tokenizer: the run's tokenizer (rank 0 tokenizes and detokenizes).
        device: where the model and communication buffers live.
        max_position_embeddings: the longest prompt + generation the model takes.
        max_tokens_to_oom: ``--max-tokens-to-oom``: the most tokens (prompts x length) in a
            request.
        use_kv_cache: keep keys and values between steps.
    """

    def __init__(self, model, pstate, tokenizer, device, max_position_embeddings: int,
                 max_tokens_to_oom: int = api.DEFAULT_MAX_TOKENS_TO_OOM,
                 use_kv_cache: bool = True):
        self.model = model
        self.pstate = pstate
        self.tokenizer = tokenizer
        self.device = device
        self.max_position_embeddings = max_position_embeddings
        self.max_tokens_to_oom = max_tokens_to_oom
        self.use_kv_cache = use_kv_cache
        self.lock = threading.Lock()
        self.multi_rank = dist.is_initialized() and dist.get_world_size() > 1

    def _send(self, signal: int) -> None:
        if self.multi_rank:
            dist.broadcast(torch.tensor([signal], dtype=torch.int64, device=self.device), src=0)

    def _run(self, payload: dict):
        """This rank's part of one generation: ``(output, None)`` or ``(None, error)``."""
        try:
            return api.generate_from_payload(self.model, self.pstate, payload, self.device,
                                              self.use_kv_cache), None
        except Exception as err:  # noqa: BLE001 - answered, logged, and serving goes on
            if not isinstance(err, GenerationError):
                print(f"generation failed on rank {dist.get_rank() if self.multi_rank else 0}:",
                      file=sys.stderr, flush=True)
                traceback.print_exception(err)
            return None, err

    def _agree_on_outcome(self, error: Optional[BaseException]) -> int:
        """The worst outcome of this generation over all ranks; every rank calls this once per
        generation, whatever happened, so they leave it together."""
        code = OK if error is None else BAD_REQUEST if isinstance(error, GenerationError) \
            else FAILED
        if not self.multi_rank:
            return code
        status = torch.tensor([code], dtype=torch.int64, device=self.device)
        dist.all_reduce(status, op=dist.ReduceOp.MAX)
        return int(status.item())

    def generate(self, body) -> dict:
        """Rank 0: answer a decoded request body.

        Raises:
            api.RequestTooLarge: prompts with more bytes than could fit (HTTP 413).
            ValueError: a bad request (HTTP 400): ``api.RequestError`` or ``GenerationError``.
            GenerationFailed: generation raised anything else, on any rank (HTTP 500).
        """
        request = api.parse_request(body)
        payload = api.prepare_payload(request, self.tokenizer, self.max_position_embeddings,
                                      self.max_tokens_to_oom)
        return api.post_process(self._generate(payload), self.tokenizer, request.logprobs)

    def complete(self, body) -> dict:
        """Rank 0: answer a decoded ``POST /completions`` body; raises as :meth:`generate`."""
        request = completions.parse_completion(body)
        payload = completions.prepare_completion(request, self.tokenizer,
                                                 self.max_position_embeddings,
                                                 self.max_tokens_to_oom)
        return completions.completion_response(request, payload, self._generate(payload),
                                               self.tokenizer)

    def _generate(self, payload: dict):
        """Rank 0: run a payload on every rank; its output, or the error to answer."""
        with self.lock:
            self._send(GENERATE_NUM)
            if self.multi_rank:
                api.broadcast_payload(payload, self.device)
            output, error = self._run(payload)
            outcome = self._agree_on_outcome(error)
        if isinstance(error, GenerationError):
            raise error
        if error is not None:
            raise GenerationFailed(f"{type(error).__name__}: {error}") from error
        if outcome == BAD_REQUEST:
            raise GenerationError("the request cannot be generated (see the log of the rank "
                                  "that refused it)")
        if outcome == FAILED:
            raise GenerationFailed("generation failed on another rank (see its log)")
        return output

    def heartbeat(self) -> None:
        """Rank 0: wake the waiting ranks (between requests) before their broadcast times out."""
        with self.lock:
            self._send(HEARTBEAT_NUM)

    def shutdown_workers(self) -> None:
        """Rank 0: let the other ranks leave :meth:`worker_loop` (nothing to do when they are
        gone already, e.g. stopped by the same signal from torchrun)."""
        with self.lock:
            try:
                self._send(SHUTDOWN_NUM)
            except RuntimeError as err:
                print(f"NOTE: could not tell the other ranks to stop: {err}", flush=True)

    def worker_step(self) -> bool:
        """Ranks other than 0: wait for rank 0's next signal and follow it (run the generation
        it announces, or just wake up); False once it says to stop."""
        signal = torch.empty(1, dtype=torch.int64, device=self.device)
        dist.broadcast(signal, src=0)
        choice = int(signal.item())
        if choice == SHUTDOWN_NUM:
            return False
        if choice == GENERATE_NUM:
            payload = api.broadcast_payload(None, self.device)
            _, error = self._run(payload)
            self._agree_on_outcome(error)  # rank 0 answers the client
        return True

    def worker_loop(self) -> None:
        """Ranks other than 0: run each generation rank 0 announces, until it shuts down."""
        while self.worker_step():
            pass


class _ReadTimeout(Exception):
    """The request did not arrive within ``--read-timeout``."""


class MegatronGenerateHandler(BaseHTTPRequestHandler):
    """``PUT /api`` and ``POST /completions``; any other method on them is 405, any other path
    404. :func:`_make_handler` gives it its service and read timeout."""

    protocol_version = "HTTP/1.1"
    server_version = "MegatronGenerate"
    service: GenerationService
    read_timeout_s: float = DEFAULT_READ_TIMEOUT_S
    # Per socket operation (set by StreamRequestHandler.setup); also bounds writes to a client
    # that stops reading.
    timeout: float = DEFAULT_READ_TIMEOUT_S

    def handle_one_request(self):
        # The whole request, not each read, must arrive in time: a client trickling a byte
        # per read would otherwise hold its thread for ever. When the deadline passes, the
        # read side is shut, so a blocked read returns end-of-file at once.
        self._timed_out = False
        self._deadline = threading.Timer(self.read_timeout_s, self._expire)
        self._deadline.daemon = True
        self._deadline.start()
        try:
            super().handle_one_request()
        finally:
            self._deadline.cancel()

    def _expire(self):
        self._timed_out = True
        try:
            self.connection.shutdown(socket.SHUT_RD)
        except OSError:
            pass  # closed already

    def _reply(self, status: int, body: dict, headers: Optional[dict] = None) -> None:
        data = json.dumps(body).encode()
        if self.close_connection:  # the last answer: its client may reconnect on reading it
            self.server.release_slot(self.request)
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(data)

    def _error(self, status: int, message: str, headers: Optional[dict] = None) -> None:
        # The body may be unread: never reuse this connection.
        self.close_connection = True
        # "message" too, as Megatron's command-line client reads it.
        self._reply(status, {"error": message, "message": message}, headers)

    def _read_body(self):
        if self._timed_out:
            raise _ReadTimeout()
        length = self.headers.get("Content-Length")
        if length is None or not (length.isascii() and length.isdigit()):
            raise api.RequestError("the request needs a Content-Length header")
        if len(length) > len(str(MAX_BODY_BYTES)) or int(length) > MAX_BODY_BYTES:
            raise api.RequestTooLarge(f"the request body is {length[:20]} bytes, more than "
                                      f"the {MAX_BODY_BYTES} this server takes")
        try:
            raw = self.rfile.read(int(length))
        except OSError:  # TimeoutError included
            raise _ReadTimeout() from None
        if len(raw) < int(length):
            raise _ReadTimeout()
        self._deadline.cancel()
        return api.decode_body(raw)

    def _answer(self, serve):
        try:
            return 200, serve(self._read_body())
        except _ReadTimeout:
            return 408, (f"the request did not arrive within {self.read_timeout_s:g} s "
                         f"(--read-timeout)")
        except api.RequestTooLarge as err:
            return 413, str(err)
        except ValueError as err:  # RequestError, GenerationError, tokenizer errors
            return 400, str(err)
        except GenerationFailed as err:  # logged with its traceback where it happened
            return 500, f"internal error: {err}"
        except Exception as err:  # noqa: BLE001 - answered, logged, and serving goes on
            traceback.print_exc()
            return 500, f"internal error: {type(err).__name__}: {err}"

    def _serve(self, serve, count):
        start = time.monotonic()
        status, answer = self._answer(serve)
        if status != 200:
            return self._error(status, answer)
        self._reply(200, answer)
        print(f"generated for {count(answer)} prompt(s) in {time.monotonic() - start:.2f} s",
              flush=True)

    def _route(self, method: str) -> None:
        path = urlparse(self.path).path
        if path == API_PATH:
            allowed = "PUT"
        elif path in COMPLETIONS_PATHS:
            allowed = "POST"
        else:
            return self._error(404, f"no such path {self.path!r}; use PUT {API_PATH} or POST "
                                    f"{COMPLETIONS_PATHS[0]}")
        if method != allowed:
            return self._error(405, f"method {method} is not allowed; use {allowed} {path}",
                               {"Allow": allowed})
        if path == API_PATH:
            return self._serve(self.service.generate, lambda answer: len(answer["text"]))
        return self._serve(self.service.complete, lambda answer: len(answer["choices"]))

    def do_PUT(self):  # noqa: N802 - http.server's naming
        self._route("PUT")

    def do_POST(self):  # noqa: N802
        self._route("POST")

    def _other_method(self):
        self._route(self.command)

    do_GET = do_DELETE = do_PATCH = _other_method  # noqa: N815

    def log_message(self, format, *args):  # noqa: A002 - http.server's signature
        sys.stderr.write(f"{self.address_string()} - {format % args}\n")


def _make_handler(service: GenerationService, read_timeout_s: float):
    """The handler class of one server: :class:`MegatronGenerateHandler` bound to ``service``."""
    return type("MegatronGenerateHandler", (MegatronGenerateHandler,),
                {"service": service, "read_timeout_s": read_timeout_s, "timeout": read_timeout_s})


def is_loopback(host: str) -> bool:
    """Whether ``host`` is reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def start_message(host: str, port: int, read_timeout_s: float, max_connections: int) -> str:
    """Where the server listens and its limits; a warning line when not on loopback."""
    text = (f" * serving PUT http://{host}:{port}{API_PATH} (--read-timeout {read_timeout_s:g} s, "
            f"--max-connections {max_connections})\n"
            f" * serving POST http://{host}:{port}{COMPLETIONS_PATHS[0]} (OpenAI-style "
            f"completions)")
    if not is_loopback(host):
        text += (f"\nWARNING: --host {host} is not a loopback address and this server has no "
                 f"authentication: anyone who can reach {host}:{port} can run generations")
    return text


class MegatronServer:
    """The HTTP front of a :class:`GenerationService` (rank 0 only).

    Args:
        service: the generation service.
        heartbeat_s: how often idle rank 0 wakes the waiting ranks.
        read_timeout_s: ``--read-timeout``: the longest a request may take to arrive.
        max_connections: ``--max-connections``: connections served at once.
    """

    def __init__(self, service: GenerationService, heartbeat_s: float = 60.0,
                 read_timeout_s: float = DEFAULT_READ_TIMEOUT_S,
                 max_connections: int = DEFAULT_MAX_CONNECTIONS):
        self.service = service
        self.heartbeat_s = heartbeat_s
        self.read_timeout_s = read_timeout_s
        self.max_connections = max_connections
        self.httpd: Optional[BoundedHTTPServer] = None
        self._stop = threading.Event()

    def _heartbeat_loop(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            self.service.heartbeat()

    def _bind(self, host: str, port: int) -> BoundedHTTPServer:
        try:
            return BoundedHTTPServer((host, port),
                                     _make_handler(self.service, self.read_timeout_s),
                                     self.max_connections)
        except OSError as err:
            raise OSError(err.errno, f"cannot listen on {host}:{port} (--host, --port): "
                                     f"{err.strerror}") from None

    def run(self, host: str, port: int,
            ready: Optional[Callable[[str, int], None]] = None) -> None:
        """Serve until interrupted; then release the other ranks (also when the address cannot
        be bound, which raises ``OSError`` naming it). ``ready(host, port)`` is called once
        listening (port 0 picks a free port)."""
        beat = None
        try:
            self.httpd = self._bind(host, port)
            port = self.httpd.server_address[1]
            if self.service.multi_rank:
                beat = threading.Thread(target=self._heartbeat_loop, daemon=True)
                beat.start()
            print(start_message(host, port, self.read_timeout_s, self.max_connections),
                  flush=True)
            if ready is not None:
                ready(host, port)
            self.httpd.serve_forever()
        finally:
            self._stop.set()
            if self.httpd is not None:
                self.httpd.server_close()
            if beat is not None:
                beat.join()
            self.service.shutdown_workers()

    def shutdown(self) -> None:
        """Stop :meth:`run` from another thread."""
        if self.httpd is not None:
            self.httpd.shutdown()
