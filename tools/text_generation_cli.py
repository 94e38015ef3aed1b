"""A small client of the text generation server (``tools/run_text_generation_server.py``).

    python tools/text_generation_cli.py localhost:5000 --prompt "Hello" --tokens-to-generate 32
    echo "Hello" | python tools/text_generation_cli.py localhost:5000

``URL`` is ``HOST:PORT`` (as Megatron's client takes it) or a full ``http://HOST:PORT/api``.
Each ``--prompt`` (repeatable), or else each non-empty line of standard input, is one prompt;
all go in one request, and each answer (prompt + generation) is printed on its own line, or the
whole response JSON with ``--json``. A refused request prints the server's message and exits 1.
"""

import argparse
import json
import sys
import urllib.error
import urllib.request


def api_url(url: str) -> str:
    """``HOST:PORT`` -> ``http://HOST:PORT/api``; a full URL is kept."""
    if "://" not in url:
        url = "http://" + url
    if url.rstrip("/").count("/") == 2:  # no path after the host
        url = url.rstrip("/") + "/api"
    return url


def put_json(url: str, body: dict, timeout: float = 600.0):
    """PUT ``body`` as JSON; returns (HTTP status, decoded JSON answer)."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="PUT",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read().decode())
    except urllib.error.HTTPError as err:
        raw = err.read().decode(errors="replace")
        try:
            return err.code, json.loads(raw)
        except json.JSONDecodeError:
            return err.code, {"error": raw}


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("url", help="HOST:PORT of the server, or http://HOST:PORT/api")
    p.add_argument("--prompt", action="append", default=None,
                   help="a prompt (repeatable); default: one prompt per line of stdin")
    p.add_argument("--tokens-to-generate", type=int, default=64)
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None, help="1 = greedy")
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--random-seed", type=int, default=None)
    p.add_argument("--add-bos", action="store_true", help="start each prompt with <eod>")
    p.add_argument("--logprobs", action="store_true")
    p.add_argument("--json", action="store_true", help="print the whole response JSON")
    return p.parse_args(argv)


def build_request(args, prompts) -> dict:
    body = {"prompts": prompts, "tokens_to_generate": args.tokens_to_generate}
    for key, value in (("temperature", args.temperature), ("top_k", args.top_k),
                       ("top_p", args.top_p), ("random_seed", args.random_seed)):
        if value is not None:
            body[key] = value
    if args.add_bos:
        body["add_BOS"] = True
    if args.logprobs:
        body["logprobs"] = True
    return body


def main(argv=None) -> int:
    args = _parse(argv)
    prompts = args.prompt
    if prompts is None:
        prompts = [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if not prompts:
        print("text_generation_cli: error: no prompt (give --prompt or lines on stdin)",
              file=sys.stderr)
        return 2
    try:
        status, answer = put_json(api_url(args.url), build_request(args, prompts))
    except (urllib.error.URLError, OSError) as err:
        print(f"text_generation_cli: error: cannot reach {api_url(args.url)}: "
              f"{getattr(err, 'reason', err)}", file=sys.stderr)
        return 1
    if status != 200:
        message = answer.get("error", answer.get("message", answer))
        print(f"text_generation_cli: error {status}: {message}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(answer))
    else:
        for text in answer["text"]:
            print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
