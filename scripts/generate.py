#!/usr/bin/env python
"""Send one generation request to a running Loom cluster and print the answer.

python scripts/generate.py --text "What is the capital of France?"
python scripts/generate.py --messages-json '[{"role": "user", "content": "Hi"}]' --stream
python scripts/generate.py --input-ids '[504, 3575, 282]' --stop "." --stop-token-ids 2 --ignore-eos
python scripts/generate.py --text "Hello" --lora my-adapter --json

--stream prints the text as it is generated; --stream --json prints one JSON object per line, one per
streamed chunk (each cumulative: the last line is the final result). Exit codes: 0 ok, 1 the server refused
or failed the request or cannot be reached (nothing listening at --endpoint: within 3 s), 2 bad flags.
If the connection drops mid-request and the server comes back within 30 s, a greedy or seeded request is
resubmitted and a stream continues where it was (--retry / --no-retry override that choice).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ipc.client import DEFAULT_ENDPOINT, LoomClient, LoomError  # noqa: E402

MESSAGES_ERROR = "--messages-json must be a JSON list of {role, content} objects"


class FlagError(ValueError):
    """A flag's value is unusable; the message says which and why."""


def build_parser() -> argparse.ArgumentParser:
    """The command-line flags."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--endpoint", default=DEFAULT_ENDPOINT, help="the cluster's front address (default %(default)s)")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--text", help="raw prompt text")
    g.add_argument("--messages-json", help="chat messages as JSON, rendered with the model's chat template")
    g.add_argument("--input-ids", help="prompt token ids as a JSON list of ints, e.g. '[1, 2, 3]'")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default %(default)s)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeat for several)")
    p.add_argument("--stop-token-ids", type=int, nargs="+", default=None, metavar="ID", help="stop token ids")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past the EOS token")
    p.add_argument("--lora", default=None, help="adapter name (default: base model)")
    p.add_argument("--stream", action="store_true", help="print text as it is generated")
    p.add_argument(
        "--allow-special-tokens-in-content",
        action="store_true",
        help="chat only (trusted callers): special-token text in a message's content becomes control tokens",
    )
    p.add_argument(
        "--json", action="store_true", help="print the result as JSON (with --stream: one JSON line per chunk)"
    )
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for a reply (default %(default)s)")
    p.add_argument(
        "--retry",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="resubmit the request if the connection drops and the server comes back (default: only when "
        "greedy or seeded, whose rerun gives the same tokens)",
    )
    return p


def parse_messages(raw: str) -> list[dict[str, str]]:
    """``--messages-json`` as a list of ``{role, content}`` dicts; raises FlagError otherwise."""
    try:
        messages = json.loads(raw)
    except json.JSONDecodeError as e:
        raise FlagError(f"{MESSAGES_ERROR} (not valid JSON: {e})") from None
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise FlagError(MESSAGES_ERROR)
    return messages


def parse_input_ids(raw: str) -> list[int]:
    """``--input-ids`` as a list of ints; raises FlagError otherwise."""
    try:
        ids = json.loads(raw)
    except json.JSONDecodeError as e:
        raise FlagError(f"--input-ids must be a JSON list of ints (not valid JSON: {e})") from None
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise FlagError("--input-ids must be a JSON list of ints")
    return ids


def sampling_params(a: argparse.Namespace) -> dict[str, Any]:
    """The request's sampling_params from the flags."""
    sp: dict[str, Any] = {
        "max_new_tokens": a.max_new_tokens,
        "temperature": a.temperature,
        "top_p": a.top_p,
        "top_k": a.top_k,
    }
    if a.seed is not None:
        sp["seed"] = a.seed
    if a.stop:
        sp["stop"] = a.stop
    if a.stop_token_ids:
        sp["stop_token_ids"] = a.stop_token_ids
    if a.ignore_eos:
        sp["ignore_eos"] = True
    return sp


def main(argv: list[str] | None = None) -> int:
    """Parse flags, send the request, print text (or JSON); exit 1 with the server's message on error (or the
    endpoint when the server cannot be reached), 2 on bad flags."""
    parser = build_parser()
    a = parser.parse_args(argv)
    if not a.timeout > 0:  # also NaN
        parser.error(f"--timeout {a.timeout}: give a number of seconds above 0")
    try:
        messages = parse_messages(a.messages_json) if a.messages_json is not None else None
        input_ids = parse_input_ids(a.input_ids) if a.input_ids is not None else None
    except FlagError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    sp = sampling_params(a)
    try:
        client = LoomClient(a.endpoint, timeout_s=a.timeout)
    except LoomError as e:  # a malformed endpoint
        print(f"error: --endpoint {a.endpoint!r} is not usable: {e}", file=sys.stderr)
        return 2
    shown = 0
    with client as c:
        try:
            out = c.generate(
                a.text,
                input_ids=input_ids,
                messages=messages,
                sampling_params=sp,
                stream=a.stream,
                lora_path=a.lora,
                retry=a.retry,
                allow_special_tokens_in_content=a.allow_special_tokens_in_content,
            )
            if a.stream:
                for chunk in out:
                    if a.json:
                        print(json.dumps(chunk), flush=True)
                    else:
                        print(chunk["text"][shown:], end="", flush=True)
                        shown = len(chunk["text"])
                if not a.json:
                    print()
            elif a.json:
                print(json.dumps(out, indent=2))
            else:
                print(out["text"])
        except LoomError as e:
            if shown:
                print(flush=True)  # end the partial streamed line before the error
            print(f"error ({e.kind}): {e.message}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
