"""``tools/run_text_generation_server.py`` as users run it, answering real HTTP requests.

A tiny GPT is saved through the real checkpoint code, the server is started on it as a
subprocess on a free port (alone, and under torchrun with TP = 2), and requests are sent with
urllib: good ones get text, bad ones get 400 with a message naming the field while the server
keeps serving, other paths and methods get 404 / 405, concurrent requests all get the same full
answer, and ``tools/text_generation_cli.py`` prints the same text. Greedy
answers of the TP = 2 server equal the single-process server's. The request checks are also run
directly on :func:`megatron.text_generation.api.parse_request`.

The TP = 2 server also takes what once killed it (issue 28): a temperature so small that the
sampling distribution overflows (400, both ranks serve on) and a few hundred fuzzed requests
(``generation_fuzz``) from three clients at once against ``--max-connections 2``: each is
answered 200, 400, 413 or 503, and greedy decoding gives the same tokens after as before.
The HTTP limits themselves are tested in ``test_text_generation_server_limits``.
"""

import collections
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

from megatron.text_generation.api import RequestError, parse_request
from tests.multiprocess import run_on_ranks

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FLAGS = """--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32
--max-position-embeddings 32 --tokenizer-type NullTokenizer --vocab-size 128
--null-tokenizer-eod-id 128 --device cpu
--seed 1234 --hidden-dropout 0 --attention-dropout 0 --init-method-std 0.2""".split()
START_DEADLINE_S = 120
GREEDY = {"prompts": ["1 2 3", "7 8 9 10 11"], "tokens_to_generate": 8, "top_k": 1,
          "logprobs": True}


def _save_random_init(layouts, root):
    """Rank body: per ``{name: flags}``, build the model from its seed and save it as iteration
    1 under ``root/name`` (on two ranks, TP = 1 runs as DP = 2 and saves a TP = 1 layout)."""
    from megatron.training import checkpointing
    from megatron.training import global_vars
    from megatron.core import parallel_state
    from megatron.inference import initialize_for_inference
    from megatron.training.training import build_model_chunks
    import pretrain_gpt

    for name, flags in layouts.items():
        args, pstate, _ = initialize_for_inference(None, flags + ["--save", f"{root}/{name}"])
        args.no_save_optim = args.no_save_rng = True
        checkpointing.save_checkpoint(1, build_model_chunks(pretrain_gpt.model_provider, pstate),
                                      None, None, args, pstate)
        global_vars.unset_global_variables()
        parallel_state.destroy_model_parallel()


def _env():
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                        "MASTER_PORT", "GROUP_RANK", "TORCHELASTIC_RUN_ID")}
    env["OMP_NUM_THREADS"] = "1"
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_listening(proc, port, log_path):
    deadline = time.monotonic() + START_DEADLINE_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            with open(log_path) as f:
                pytest.fail(f"server exited with {proc.returncode}:\n{f.read()[-4000:]}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)   # polling interval; the deadline bounds the wait
    pytest.fail(f"server did not listen on port {port} within {START_DEADLINE_S} s")


class Server:
    """The server as a subprocess in its own session (so all its ranks are stopped together)."""

    def __init__(self, load, tmp_path, launcher=(), extra=()):
        self.port = _free_port()
        self.log_path = str(tmp_path / f"server_{self.port}.log")
        cmd = [sys.executable, *launcher, "tools/run_text_generation_server.py", *FLAGS,
               *extra, "--load", load, "--port", str(self.port), "--host", "127.0.0.1"]
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=_env(), stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        self.url = f"http://127.0.0.1:{self.port}/api"

    def __enter__(self):
        try:
            _wait_listening(self.proc, self.port, self.log_path)
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc):
        self.stop()

    def stop(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()

    def request(self, body, method="PUT", path="/api"):
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", data=data,
                                     method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read())


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("server_ckpt")
    layouts = {"tp1": FLAGS, "tp2": FLAGS + ["--tensor-model-parallel-size", "2"]}
    run_on_ranks(_save_random_init, 2, layouts, str(root))
    return root


@pytest.fixture(scope="module")
def single_server(checkpoints, tmp_path_factory):
    """The single-process server, shared by the tests of this module."""
    with Server(str(checkpoints / "tp1"), tmp_path_factory.mktemp("server_log")) as server:
        yield server
    assert server.proc.returncode is not None


def _check_greedy(answer):
    assert set(answer) == {"text", "segments", "logprobs", "tokens"}
    for prompt, text, segments, logprobs, ids in zip(GREEDY["prompts"], answer["text"],
                                                      answer["segments"], answer["logprobs"],
                                                      answer["tokens"]):
        prompt_ids = [int(t) for t in prompt.split()]
        assert ids[:len(prompt_ids)] == prompt_ids
        # As in Megatron, every sequence may grow to the longest prompt + tokens_to_generate.
        assert len(prompt_ids) < len(ids) <= 5 + GREEDY["tokens_to_generate"]
        assert all(0 <= t <= 128 for t in ids)             # never a padded-vocabulary id
        assert text == " ".join(map(str, ids)) and segments == [str(t) for t in ids]
        assert len(logprobs) == len(ids) - 1 and all(lp <= 0.0 for lp in logprobs)


COMPLETION = {"prompt": ["1 2 3", "7 8 9 10 11"], "max_tokens": 8, "temperature": 0,
              "echo": True, "logprobs": 1}


def _check_completion(completion, greedy):
    """``COMPLETION``'s answer against ``GREEDY``'s from ``PUT /api`` (the same prompts): the
    same tokens, up to 8 generated and the end of document, and log-probabilities."""
    assert [c["index"] for c in completion["choices"]] == [0, 1]
    for choice, ids, logprobs in zip(completion["choices"], greedy["tokens"],
                                     greedy["logprobs"]):
        n = len(choice["logprobs"]["tokens"])
        prompt = 3 if choice["index"] == 0 else 5
        want = ids[:prompt + 8]
        if want[-1] == 128:                   # the end of the document is not returned
            want = want[:-1]
        assert choice["logprobs"]["tokens"] == [str(t) for t in want]
        assert choice["text"] == " ".join(map(str, want))
        assert choice["logprobs"]["token_logprobs"][0] is None
        assert choice["logprobs"]["token_logprobs"][1:] == pytest.approx(logprobs[:n - 1],
                                                                         abs=2e-5)
        assert all(len(top) == 1 for top in choice["logprobs"]["top_logprobs"][1:])


BAD_REQUESTS = [
    ({"prompts": "1 2 3"}, "prompts is not a list of strings"),
    ({"prompts": [1, 2]}, "prompts is not a list of strings"),
    ({"prompts": []}, "prompts is empty"),
    ({"prompts": [""]}, "Empty prompts require add_BOS"),
    ({"tokens_to_generate": 4}, "prompts argument required"),
    ({"prompts": ["1"], "tokens_to_generate": -1}, "tokens_to_generate"),
    ({"prompts": ["1"], "tokens_to_generate": "4"}, "tokens_to_generate"),
    ({"prompts": ["1"], "tokens_to_generate": 2.5}, "tokens_to_generate"),
    ({"prompts": ["1"], "tokens_to_generate": True}, "tokens_to_generate"),
    ({"prompts": ["1"], "tokens_to_generate": 0}, "implies logprobs"),
    ({"prompts": ["1"], "temperature": 0}, "temperature"),
    ({"prompts": ["1"], "temperature": 101}, "temperature"),
    ({"prompts": ["1"], "top_k": -2}, "top_k"),
    ({"prompts": ["1"], "top_p": 1.5}, "top_p"),
    ({"prompts": ["1"], "top_k": 4, "top_p": 0.5}, "both top-k and top-p"),
    ({"prompts": ["1"], "logprobs": "yes"}, "logprobs"),
    ({"prompts": ["1"], "add_BOS": 1}, "add_BOS"),
    ({"prompts": ["1"], "random_seed": -3}, "random_seed"),
    ({"prompts": ["1"], "stop_token": "x"}, "stop_token"),
    ({"prompts": ["1"], "max_len": 5}, "max_len is no longer used"),
    ({"prompts": ["1", "2"], "beam_width": 2}, "batch size must be 1"),
    (["1 2"], "JSON object"),
]


@pytest.mark.parametrize("body, message", BAD_REQUESTS)
def test_parse_request_refuses(body, message):
    with pytest.raises(RequestError, match=message):
        parse_request(body)


def test_parse_request_defaults_and_values():
    req = parse_request({"prompts": ["a"]})
    assert (req.tokens_to_generate, req.logprobs, req.temperature, req.top_k, req.top_p,
            req.add_BOS, req.stop_token, req.random_seed) == (64, False, 1.0, 0, 0.0, False,
                                                              None, None)
    req = parse_request({"prompts": ["", "b"], "add_BOS": True, "tokens_to_generate": 0,
                         "logprobs": True, "temperature": 2, "top_p": 0.5, "stop_token": 3,
                         "random_seed": 11, "no_log": True})
    assert (req.prompts, req.temperature, req.top_p, req.stop_token, req.random_seed) == (
        ["", "b"], 2.0, 0.5, 3, 11)


def _cli(url, *args, stdin=None):
    return subprocess.run([sys.executable, "tools/text_generation_cli.py", url, *args],
                          cwd=REPO_ROOT, env=_env(), input=stdin, capture_output=True,
                          text=True, timeout=60)


def test_server_answers_good_and_bad_requests(single_server):
    server = single_server
    status, first = server.request(GREEDY)
    assert status == 200, first
    _check_greedy(first)
    server_http_errors = [
        (b"{not json", "not valid JSON"),
        ({"prompts": ["1 2 3"], "tokens_to_generate": 30}, "--max-position-embeddings"),
        ({"prompts": ["1 2 300"]}, "outside the vocabulary"),
        ({"prompts": ["one two"]}, "cannot be tokenized"),
        ({"prompts": ["1"], "tokens_to_generate": 4, "stop_token": 500}, "stop_token"),
        ({"prompts": ["1"], "tokens_to_generate": 4, "stop_on_eol": True},
         "stop_on_eol needs '\\n' to be one token"),
    ]
    for body, message in BAD_REQUESTS[:12] + server_http_errors:
        status, answer = server.request(body)
        assert status == 400 and message in answer["error"], (body, status, answer)
    assert server.request(GREEDY) == (200, first)     # still serving, same answer
    assert server.request({}, method="POST")[0] == 405
    assert server.request(GREEDY, path="/other")[0] == 404
    # The OpenAI-style endpoint: the same greedy continuation and log-probabilities.
    status, completion = server.request(COMPLETION, method="POST", path="/completions")
    assert status == 200, completion
    _check_completion(completion, first)
    status, again = server.request(COMPLETION, method="POST", path="/v1/completions")
    assert status == 200 and again["choices"] == completion["choices"]
    assert server.request(COMPLETION, path="/completions")[0] == 405      # PUT
    status, answer = server.request({"prompt": "1", "n": 2}, method="POST",
                                    path="/completions")
    assert status == 400 and "n other than 1" in answer["error"], answer
    # Sampling: a seed fixes the answer; a scoring request gives the greedy prompt scores.
    sampled = {"prompts": ["4 5"], "tokens_to_generate": 6, "top_p": 0.9, "random_seed": 3}
    assert server.request(sampled) == server.request(sampled)
    status, score = server.request({"prompts": ["1 2 3"], "tokens_to_generate": 0,
                                    "logprobs": True})
    assert status == 200 and score["tokens"] == [[1, 2, 3]]
    assert score["logprobs"][0] == pytest.approx(first["logprobs"][0][:2], abs=2e-5)
    # Concurrent requests (the server's threads queue on its lock) each get the full answer.
    answers = [None] * 3

    def ask(i):
        answers[i] = server.request(GREEDY)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert answers == [(200, first)] * 3
    # The command-line client prints the same text.
    cli = _cli(f"127.0.0.1:{server.port}", "--tokens-to-generate", "8", "--top-k", "1",
               stdin="1 2 3\n7 8 9 10 11\n")
    assert cli.returncode == 0, cli.stderr
    assert cli.stdout.splitlines() == first["text"]
    cli = _cli(server.url, "--prompt", "1", "--tokens-to-generate", "40")
    assert cli.returncode == 1 and "error 400" in cli.stderr


@pytest.fixture(scope="module")
def tp2_server(checkpoints, tmp_path_factory):
    """The server under torchrun with TP = 2, shared by the tests below; at most 2 connections
    at once, so concurrent clients also meet the 503."""
    logs = tmp_path_factory.mktemp("tp2_log")
    # torchrun's own log folder goes there too, not into a /tmp/torchelastic_* left behind.
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                "--log-dir", str(logs / "torchrun")]
    extra = ["--tensor-model-parallel-size", "2", "--max-connections", "2",
             "--read-timeout", "10"]
    with Server(str(checkpoints / "tp2"), logs, launcher, extra) as server:
        yield server
    assert server.proc.returncode is not None


def test_torchrun_tensor_parallel_server_matches_single_process(tp2_server, single_server):
    server = tp2_server
    status, answer = server.request(GREEDY)
    assert status == 200, answer
    _check_greedy(answer)
    assert server.request({"prompts": []})[0] == 400
    status, again = server.request(GREEDY)
    _, want = single_server.request(GREEDY)
    assert answer["tokens"] == again["tokens"] == want["tokens"]
    for a, b in zip(answer["logprobs"], want["logprobs"]):
        assert a == pytest.approx(b, abs=2e-5)
    # Beam search: the same hypotheses and scores over TP = 2 as in one process.
    beams = {"prompts": ["5 6 7"], "tokens_to_generate": 5, "beam_width": 3,
             "length_penalty": 0.5}
    (status, got), (status_one, one) = server.request(beams), single_server.request(beams)
    assert status == status_one == 200, (got, one)
    assert set(got) == {"text", "segments", "scores", "tokens"} and len(got["tokens"]) == 3
    assert got["tokens"] == one["tokens"] and got["text"] == one["text"]
    assert got["scores"] == pytest.approx(one["scores"], abs=2e-5)
    assert got["scores"] == sorted(got["scores"], reverse=True)
    # The completions endpoint: the same answer over TP = 2 as in one process.
    (status, got), (status_one, one) = (
        s.request(COMPLETION, method="POST", path="/completions")
        for s in (server, single_server))
    assert status == status_one == 200, (got, one)
    _check_completion(got, answer)
    for a, b in zip(got["choices"], one["choices"]):
        assert a["text"] == b["text"] and a["logprobs"]["tokens"] == b["logprobs"]["tokens"]
        assert a["logprobs"]["token_logprobs"][1:] == pytest.approx(
            b["logprobs"]["token_logprobs"][1:], abs=2e-5)


def test_failed_generation_answers_400_and_both_ranks_keep_serving(tp2_server):
    """Issue 28: temperature 1e-300 made rank 1's torch.multinomial raise, rank 1 died and
    torchrun stopped rank 0. Now both ranks refuse it at the same step and serve on."""
    server = tp2_server
    status, before = server.request(GREEDY)
    assert status == 200, before
    for temperature in (1e-300, 1e-45):
        status, answer = server.request({"prompts": ["1 2"], "tokens_to_generate": 4,
                                         "temperature": temperature})
        assert status == 400, answer
        assert f"not finite at temperature {temperature!r}" in answer["error"]
    assert server.request(GREEDY) == (200, before)
    assert server.proc.poll() is None
    with open(server.log_path) as f:
        assert "Traceback" not in f.read()


FUZZ_REQUESTS = 300
FUZZ_REQUESTS_SLOW = 2000


@pytest.mark.parametrize("count", [
    pytest.param(FUZZ_REQUESTS, id="short"),
    pytest.param(FUZZ_REQUESTS_SLOW, id="long", marks=pytest.mark.slow),
])
def test_fuzzed_requests_are_answered_and_the_server_lives(tp2_server, count):
    """Random requests (types, ranges, keys, sizes; see ``generation_fuzz``) from 3 clients at
    once: every one gets 200, 400, 413 or 503, and greedy decoding gives the same tokens after
    as before."""
    from tests.functional.generation_fuzz import fuzz_bodies, fuzz_completion_bodies

    server = tp2_server
    status, before = server.request(GREEDY)
    assert status == 200, before
    bodies = [("PUT", "/api", body) for body in fuzz_bodies(count, seed=count)]
    completions = fuzz_completion_bodies(count // 2, seed=count)
    bodies[1::3] = [("POST", "/completions", body) for body in completions[:len(bodies[1::3])]]
    answers = [None] * len(bodies)

    def client(first):
        for i in range(first, len(bodies), 3):
            method, path, body = bodies[i]
            answers[i] = server.request(body, method=method, path=path)

    threads = [threading.Thread(target=client, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for path in ("/api", "/completions"):
        statuses = collections.Counter(status for (_, p, _), (status, _) in zip(bodies, answers)
                                       if p == path)
        assert statuses[200] > 0 and statuses[400] > 0, (path, statuses)
    for (_, path, body), (status, answer) in zip(bodies, answers):
        assert status in (200, 400, 413, 503), (path, body[:200], status, answer)
        assert status == 200 or answer["error"], (path, body[:200], answer)
    assert server.request(GREEDY) == (200, before)
    assert server.proc.poll() is None
