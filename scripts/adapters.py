#!/usr/bin/env python
"""Manage the LoRA adapters of a running Loom cluster.

python scripts/adapters.py list
python scripts/adapters.py load NAME PATH [--pinned]
python scripts/adapters.py unload NAME
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ipc.client import DEFAULT_ENDPOINT, LoomClient, LoomError  # noqa: E402


def _slots(slots: dict[str, int]) -> str:
    return ", ".join(f"{k}: slot {v}" for k, v in sorted(slots.items())) or "-"


def main(argv: list[str] | None = None) -> int:
    """Run one sub-command; exit 1 with the server's message on error, 2 on bad flags (an unusable --endpoint)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--endpoint", default=DEFAULT_ENDPOINT)
    p.add_argument("--json", action="store_true")
    # the same options after the sub-command too (``adapters.py list --endpoint ...``); SUPPRESS keeps the value
    # given before it when they are not repeated
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--endpoint", default=argparse.SUPPRESS, help=f"the cluster (default {DEFAULT_ENDPOINT})")
    common.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="print JSON")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", parents=[common], help="name, uid, path, rank, pinned and slots per TP rank")
    ld = sub.add_parser("load", parents=[common], help="load a PEFT adapter folder")
    ld.add_argument("name")
    ld.add_argument("path")
    ld.add_argument("--pinned", action="store_true")
    ul = sub.add_parser("unload", parents=[common], help="unload an adapter")
    ul.add_argument("name")
    a = p.parse_args(argv)
    try:
        client = LoomClient(a.endpoint, timeout_s=600)
    except LoomError as e:  # a malformed endpoint
        print(f"error: --endpoint {a.endpoint!r} is not usable: {e}", file=sys.stderr)
        return 2
    with client as c:
        try:
            if a.cmd == "list":
                rows = c.list_loras()
                if a.json:
                    print(json.dumps(rows, indent=2))
                    return 0
                print(f"{'name':<16} {'uid':<36} {'rank':>4} {'pinned':<6} {'slots':<28} path")
                for r in rows:
                    print(
                        f"{r['name']:<16} {r['uid']:<36} {r['rank']:>4} {str(r['pinned']):<6} "
                        f"{_slots(r['slots']):<28} {r['path']}"
                    )
            elif a.cmd == "load":
                print(json.dumps(c.load_lora_adapter(a.name, a.path, a.pinned)))
            else:
                print(json.dumps(c.unload_lora_adapter(a.name)))
        except LoomError as e:  # the kind says whether to fix the call (bad_request, not_found) or wait (unavailable)
            print(f"error ({e.kind}): {e.message}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
