"""The generation server's limits (issue 28), over real HTTP in this process, loopback only.

``MegatronServer`` runs on a free 127.0.0.1 port with a stub service that does the real request
checks (``api.parse_request``, ``api.prepare_payload``) with a NullTokenizer counting its calls,
and answers without a model. Reproductions, each failing before:

* idle connections and clients that send headers with ``Content-Length: 1000`` and 13 body bytes
  stayed open for ever, each holding a thread; a client trickling its headers a byte at a time
  (each byte well inside any per-read timeout) did too;
* connections were never bounded (now one over ``--max-connections`` gets 503 at once);
* a 15 MB one-word prompt was tokenized in full before the length check (now 413, and the
  tokenizer is never called: checked by its call count, not by time);
* unknown keys were ignored (a misspelt ``top_K`` changed nothing);
* a 5000-digit ``tokens_to_generate`` got Python's integer-conversion message;
* the default address was 0.0.0.0 (every interface, no authentication).

Waits are polls with deadlines; every socket and the server thread are closed at the end.
"""

import argparse
import contextlib
import http.client
import json
import re
import socket
import threading
import time

import pytest

from megatron.text_generation import api
from megatron.text_generation.server import MegatronServer, is_loopback, start_message
from megatron.tokenizer.tokenizer import NullTokenizer

DEADLINE_S = 20.0
MAX_POSITIONS = 32


class CountingTokenizer(NullTokenizer):
    """NullTokenizer (ids 0..127, eod 128 appended) that counts its calls."""

    def __init__(self):
        super().__init__(128, eod_id=128)
        self.calls = 0

    def tokenize(self, text):
        self.calls += 1
        return super().tokenize(text)


class StubService:
    """The request checks of ``GenerationService.generate``, without a model."""

    multi_rank = False

    def __init__(self):
        self.tokenizer = CountingTokenizer()

    def generate(self, body):
        request = api.parse_request(body)
        payload = api.prepare_payload(request, self.tokenizer, MAX_POSITIONS)
        return {"text": request.prompts, "segments": None, "logprobs": None,
                "tokens": payload["tokens"]}

    def heartbeat(self):
        pass

    def shutdown_workers(self):
        pass


@contextlib.contextmanager
def serving(service, **limits):
    """``MegatronServer(service, **limits)`` on a free loopback port; yields the port."""
    server = MegatronServer(service, **limits)
    ready, where = threading.Event(), {}

    def on_ready(host, port):
        where["port"] = port
        ready.set()

    thread = threading.Thread(target=server.run, args=("127.0.0.1", 0, on_ready), daemon=True)
    thread.start()
    try:
        assert ready.wait(DEADLINE_S), "the server did not start"
        yield where["port"]
    finally:
        server.shutdown()
        thread.join(DEADLINE_S)
    assert not thread.is_alive()


def put(port, body, headers=None):
    """(status, decoded JSON answer) of one ``PUT /api``; ``body`` is an object or raw bytes."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=DEADLINE_S)
    try:
        conn.request("PUT", "/api", body=data,
                     headers={"Content-Type": "application/json", **(headers or {})})
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def put_until_served(port, body):
    """Retry while the server is still releasing connection slots (503), up to the deadline."""
    deadline = time.monotonic() + DEADLINE_S
    while True:
        status, answer = put(port, body)
        if status != 503 or time.monotonic() > deadline:
            return status, answer


def read_until_closed(sock, deadline, nudge=None):
    """Everything the server sends until it closes ``sock`` (None if still open at the
    deadline). ``nudge()`` is called between short reads (a trickling client sends a byte)."""
    received = b""
    sock.settimeout(0.1)
    while time.monotonic() < deadline:
        try:
            chunk = sock.recv(65536)
        except socket.timeout:
            if nudge is not None:
                try:
                    nudge()
                except OSError:   # the server closed while we were sending
                    return received
            continue
        except ConnectionResetError:
            return received
        if not chunk:
            return received
        received += chunk
    return None


def connect(port):
    return socket.create_connection(("127.0.0.1", port), timeout=DEADLINE_S)


GOOD = {"prompts": ["1 2 3"], "tokens_to_generate": 4}
SLOW_HEADERS = b"PUT /api HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n" + b'{"prompts": ['


def test_idle_slow_and_trickling_clients_are_cut_off_by_the_read_timeout():
    clients = 11
    with serving(StubService(), read_timeout_s=1.0, max_connections=clients) as port:
        with contextlib.ExitStack() as stack:
            trickle = stack.enter_context(connect(port))
            trickle.sendall(b"PUT /api HTTP/1.1\r\n")
            idle = [stack.enter_context(connect(port)) for _ in range(5)]
            slow = [stack.enter_context(connect(port)) for _ in range(5)]
            for sock in slow:
                sock.sendall(SLOW_HEADERS)
            deadline = time.monotonic() + DEADLINE_S
            # A header byte every 0.1 s: each read is well inside 1 s, the request is not.
            answer = read_until_closed(trickle, deadline, nudge=lambda: trickle.send(b"X"))
            assert answer is not None, "the trickling client was never cut off"
            # Meanwhile the others were cut off too; what the server sent waits in their buffers.
            answers = [read_until_closed(sock, deadline) for sock in idle + slow]
            assert answers[:5] == [b""] * 5, answers
            for answer in answers[5:]:
                assert answer is not None and answer.startswith(b"HTTP/1.1 408 "), answers
                assert b"--read-timeout" in answer
        # Every slot is free again, and the server still serves.
        status, answer = put_until_served(port, GOOD)
        assert status == 200 and answer["tokens"] == [[1, 2, 3]]


def test_connections_over_the_bound_get_503_at_once():
    with serving(StubService(), read_timeout_s=DEADLINE_S, max_connections=2) as port:
        with connect(port) as first, connect(port) as second:
            # Accepted in order: these two hold both slots, idle, until closed.
            status, answer = put(port, GOOD)
            assert status == 503 and "--max-connections" in answer["error"], answer
            with connect(port) as raw:   # before sending anything: answered at once
                answer = read_until_closed(raw, time.monotonic() + DEADLINE_S)
            assert answer is not None and answer.startswith(b"HTTP/1.1 503 ")
        status, answer = put_until_served(port, GOOD)
        assert status == 200, answer


def test_huge_prompt_is_refused_before_tokenizing():
    service = StubService()
    with serving(service, read_timeout_s=DEADLINE_S) as port:
        status, answer = put(port, {"prompts": ["1" * 15_000_000], "tokens_to_generate": 4})
        assert status == 413, answer
        assert "prompts[0] is 15000000 bytes" in answer["error"]
        assert "--max-position-embeddings (32)" in answer["error"]
        assert service.tokenizer.calls == 0
        # At the bound (32 positions x 128 bytes) a prompt is tokenized, and found too long.
        status, answer = put(port, {"prompts": ["1 " * 2048]})
        assert status == 400 and "--max-position-embeddings" in answer["error"]
        assert service.tokenizer.calls == 1
        # A Content-Length over the body limit is refused before the body is read.
        with connect(port) as raw:
            raw.sendall(b"PUT /api HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999999\r\n\r\n")
            answer = read_until_closed(raw, time.monotonic() + DEADLINE_S)
        assert answer is not None and answer.startswith(b"HTTP/1.1 413 ")
        status, answer = put(port, GOOD)
        assert status == 200


def test_all_prompts_together_are_bounded_before_tokenizing():
    tokenizer = CountingTokenizer()
    request = api.parse_request({"prompts": ["1 " * 500, "2 " * 500]})
    with pytest.raises(api.RequestTooLarge, match=r"2000 bytes together.*--max-tokens-to-oom"):
        api.prepare_payload(request, tokenizer, MAX_POSITIONS, max_tokens_to_oom=10)
    assert tokenizer.calls == 0


def test_unknown_keys_and_long_integers_are_400_naming_them():
    with serving(StubService(), read_timeout_s=DEADLINE_S) as port:
        status, answer = put(port, {"prompts": ["1"], "top_K": 1})
        assert status == 400, answer
        assert "unknown request key(s) 'top_K' (did you mean 'top_k'?)" in answer["error"]
        body = b'{"prompts": ["1"], "tokens_to_generate": ' + b"7" * 5000 + b"}"
        status, answer = put(port, body)
        assert status == 400, answer
        assert answer["error"].startswith("tokens_to_generate must be an integer")
        assert "5000 digits" in answer["error"]


NUMERIC_FIELDS = {
    # field: values of the wrong type or out of range
    "tokens_to_generate": ["4", 2.5, True, None, [4], -1, api.LongInteger("9" * 50)],
    "temperature": ["1", None, True, 0, -1.0, 101, float("nan"), float("inf")],
    "top_k": ["1", 1.0, False, -1, 1001, api.LongInteger("9" * 50)],
    "top_p": ["0.5", None, -0.1, 1.5, float("nan")],
    "stop_token": ["1", 1.5, -1, True, api.LongInteger("9" * 50)],
    "random_seed": ["1", 1.5, -1, 2 ** 63, False],
    "length_penalty": ["1", None, [1]],
    "logprobs": [1, "true", None],
    "add_BOS": [1, "true"],
    "no_log": [1, "yes"],
}


@pytest.mark.parametrize("field, value", [(f, v) for f, values in NUMERIC_FIELDS.items()
                                          for v in values])
def test_each_bad_field_is_named(field, value):
    with pytest.raises(api.RequestError) as err:
        api.parse_request({"prompts": ["1"], field: value})
    assert str(err.value).startswith(f"{field} must be"), str(err.value)


def test_out_of_range_values_that_need_the_tokenizer_are_named():
    tokenizer = CountingTokenizer()
    for body, message in [({"top_k": 200}, "top_k (200) is larger than the vocabulary"),
                          ({"stop_token": 129}, "stop_token must be a token id in [0, 129)"),
                          ({"tokens_to_generate": 10 ** 18}, "tokens_to_generate")]:
        request = api.parse_request({"prompts": ["1"], "tokens_to_generate": 4, **body})
        with pytest.raises(api.RequestError, match=re.escape(message)):
            api.prepare_payload(request, tokenizer, MAX_POSITIONS)


def test_default_host_is_loopback_and_other_hosts_are_warned_about(capsys):
    from tools import run_text_generation_server as tool

    args = tool.add_text_generate_args(argparse.ArgumentParser()).parse_args([])
    assert (args.host, args.read_timeout, args.max_connections) == ("127.0.0.1", 30.0, 16)
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.0.0.2", "localhost", "::1"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "10.1.2.3", "::", "example.org"))
    with serving(StubService(), read_timeout_s=5.0, max_connections=3) as port:
        pass
    out = capsys.readouterr().out
    assert (f" * serving PUT http://127.0.0.1:{port}/api (--read-timeout 5 s, "
            f"--max-connections 3)") in out
    assert "WARNING" not in out
    assert f" * serving POST http://127.0.0.1:{port}/completions" in out
    warning = start_message("0.0.0.0", 5000, 30.0, 16).splitlines()[2]
    assert warning.startswith("WARNING: --host 0.0.0.0 is not a loopback address and this "
                              "server has no authentication")
