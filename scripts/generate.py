#!/usr/bin/env python
"""Send one generation request to a running Loom cluster and print the answer.

python scripts/generate.py --text "What is the capital of France?"
python scripts/generate.py --messages-json '[{"role": "user", "content": "Hi"}]' --stream
python scripts/generate.py --text "Hello" --lora my-adapter --json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ipc.client import DEFAULT_ENDPOINT, LoomClient, LoomError  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    """Parse flags, send the request, print text (or JSON); exit 1 with the server's message on error."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--endpoint", default=DEFAULT_ENDPOINT)
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--text", help="raw prompt text")
    g.add_argument("--messages-json", help="chat messages as JSON, rendered with the model's chat template")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--lora", default=None, help="adapter name (default: base model)")
    p.add_argument("--stream", action="store_true", help="print text as it is generated")
    p.add_argument("--json", action="store_true", help="print the whole result as JSON")
    p.add_argument("--timeout", type=float, default=600.0)
    a = p.parse_args(argv)
    sp = {"max_new_tokens": a.max_new_tokens, "temperature": a.temperature, "top_p": a.top_p, "top_k": a.top_k}
    if a.seed is not None:
        sp["seed"] = a.seed
    try:
        messages = json.loads(a.messages_json) if a.messages_json else None
    except json.JSONDecodeError as e:
        print(f"error: --messages-json is not valid JSON: {e}", file=sys.stderr)
        return 2
    with LoomClient(a.endpoint, timeout_s=a.timeout) as c:
        try:
            out = c.generate(a.text, messages=messages, sampling_params=sp, stream=a.stream, lora_path=a.lora)
            if a.stream:
                shown, last = 0, None
                for last in out:
                    if not a.json:
                        print(last["text"][shown:], end="", flush=True)
                        shown = len(last["text"])
                out = last
                if not a.json:
                    print()
            if a.json:
                print(json.dumps(out, indent=2))
            elif not a.stream:
                print(out["text"])
        except LoomError as e:
            print(f"error ({e.kind}): {e.message}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
