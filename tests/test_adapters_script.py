"""scripts/adapters.py's command line, without a cluster: options are taken before and after the sub-command."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

import adapters  # noqa: E402

from ipc.client import DEFAULT_ENDPOINT  # noqa: E402


class FakeClient:
    """Records the endpoint it was opened on; answers list_loras with nothing."""

    opened: list[str] = []

    def __init__(self, endpoint: str, timeout_s: float) -> None:
        FakeClient.opened.append(endpoint)

    def __enter__(self) -> FakeClient:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def list_loras(self) -> list:
        return []


@pytest.mark.parametrize(
    ("argv", "endpoint", "as_json"),
    [
        (["list"], DEFAULT_ENDPOINT, False),
        (["--endpoint", "ipc:///tmp/a", "list"], "ipc:///tmp/a", False),
        (["list", "--endpoint", "ipc:///tmp/b", "--json"], "ipc:///tmp/b", True),
        (["--json", "--endpoint", "ipc:///tmp/c", "list"], "ipc:///tmp/c", True),
    ],
)
def test_endpoint_and_json_before_or_after_the_sub_command(monkeypatch, capsys, argv, endpoint, as_json):
    """``--endpoint`` used to be refused after the sub-command (``adapters.py list --endpoint X``)."""
    monkeypatch.setattr(adapters, "LoomClient", FakeClient)
    FakeClient.opened.clear()
    assert adapters.main(argv) == 0
    assert FakeClient.opened == [endpoint]
    out = capsys.readouterr().out
    assert (out.strip() == "[]") == as_json


def test_an_unusable_endpoint_is_a_flag_error(capsys):
    """It used to end in a zmq.error.ZMQError traceback with exit code 1."""
    assert adapters.main(["--endpoint", "garbage", "list"]) == 2
    assert "error: --endpoint 'garbage' is not usable" in capsys.readouterr().err


def test_a_server_error_names_its_kind(monkeypatch, capsys):
    """Errors printed only their message, so an unreachable server read like a refused call."""
    from ipc.client import LoomError

    class DownClient(FakeClient):
        def list_loras(self) -> list:
            raise LoomError("no reply from the server in 600 s", "unavailable")

    monkeypatch.setattr(adapters, "LoomClient", DownClient)
    assert adapters.main(["list"]) == 1
    assert "error (unavailable): no reply from the server" in capsys.readouterr().err
