"""``kvtier warm`` and :func:`kvtier.ops.warm_cmd.warm` end to end against an in-process warm-up endpoint.

The endpoint serves on the test's event loop (asyncio and trio) with a fake engine; the blocking
client and the CLI run in a worker thread.
"""

from __future__ import annotations

import io
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import pytest
import zmq.auth
from warm_fakes import FakeEngine, Outcome
from warm_fakes import serving as serving_server

from kvtier import cli
from kvtier.ops.warm_cmd import WarmupError, run_warm_cli, warm


def fs_tier_outcome(call: dict[str, Any]) -> Outcome:
    """The engine of these tests: one fs tier; a prefetch naming another tier is refused."""
    if call.get("tiers") == ["nvme"]:
        raise ValueError("tiers[0] = 'nvme' names no tier of this engine (its tiers: 1:fs)")
    return Outcome(tokens=len(call["token_ids"]), chunks_by_tier={"1:fs": 1}, pending=1, timed_out=True)


@asynccontextmanager
async def serving(engine: FakeEngine, **options: Any) -> AsyncIterator[str]:
    """The endpoint of a warm-up server for ``engine``."""
    async with serving_server(engine, **options) as server:
        assert server.endpoint is not None
        yield server.endpoint


async def cli_in_thread(*argv: str) -> tuple[int, list[dict[str, Any]]]:
    out = io.StringIO()
    rc = await anyio.to_thread.run_sync(lambda: run_warm_cli(list(argv), out=out))
    return rc, [json.loads(line) for line in out.getvalue().splitlines()]


def tokens_file(tmp_path: Path, content: Any, name: str = "tokens.json") -> str:
    path = tmp_path / name
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return str(path)


@pytest.mark.anyio
async def test_the_cli_prints_the_outcome_as_one_json_line(tmp_path: Path) -> None:
    engine = FakeEngine(fs_tier_outcome)
    salt = tmp_path / "salt"
    salt.write_text("tenant-a-salt\n")
    tokens = tokens_file(tmp_path, {"token_ids": [5, 6, 7, 8], "mm_items": [["img", 0, 2]]})
    async with serving(engine) as endpoint:
        rc, lines = await cli_in_thread(endpoint, "--tokens-file", tokens, "--cache-salt-file", str(salt),
                                        "--tier", "0", "--tier", "1:fs", "--max-load-tokens", "4",
                                        "--deadline", "2.5", "--no-evict", "--lora-name", "a", "--lora-path", "/a")
    assert rc == 0
    (reply,) = lines
    assert reply["type"] == "outcome" and reply["tokens"] == 4 and reply["chunks_by_tier"] == {"1:fs": 1}
    assert reply["pending"] == 1 and reply["timed_out"] is True
    (call,) = engine.calls
    assert call["cache_salt"] == "tenant-a-salt" and call["tiers"] == [0, "1:fs"] and call["evict"] is False
    assert call["params"] == {"max_load_tokens": 4} and call["deadline_s"] == 2.5
    assert call["mm_items"] == [("img", 0, 2)] and (call["lora_name"], call["lora_path"]) == ("a", "/a")


@pytest.mark.anyio
async def test_the_verb_is_dispatched_by_kvtier_main(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tokens = tokens_file(tmp_path, [1, 2, 3, 4])
    async with serving(FakeEngine(fs_tier_outcome)) as endpoint:
        rc = await anyio.to_thread.run_sync(lambda: cli.main(["warm", endpoint, "--tokens-file", tokens]))
    out = capsys.readouterr().out
    assert rc == 0 and json.loads(out)["type"] == "outcome"
    assert "warm" in cli.COMMANDS


@pytest.mark.anyio
async def test_an_error_reply_is_printed_and_exits_1(tmp_path: Path) -> None:
    async with serving(FakeEngine(fs_tier_outcome), max_tokens=3) as endpoint:
        rc, lines = await cli_in_thread(endpoint, "--tokens-file", tokens_file(tmp_path, [1, 2, 3, 4]))
        assert rc == 1 and lines[0]["type"] == "error" and lines[0]["code"] == "too_large"
        rc, lines = await cli_in_thread(endpoint, "--tokens-file", tokens_file(tmp_path, [1]), "--tier", "nvme")
        assert rc == 1 and lines[0]["code"] == "bad_request" and "names no tier" in lines[0]["message"]


@pytest.mark.anyio
async def test_no_reply_exits_1_with_the_reason_on_stderr(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    async with serving(FakeEngine(fs_tier_outcome)) as endpoint:
        pass  # closed: nothing listens there any more
    rc, lines = await cli_in_thread(endpoint, "--tokens-file", tokens_file(tmp_path, [1]), "--timeout", "0.3")
    assert rc == 1 and lines == []
    assert "no reply from" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["not-an-endpoint", "--tokens-file", "{tokens}"], "is not tcp://HOST:PORT"),
    (["tcp://127.0.0.1:0", "--tokens-file", "{tokens}"], "is not tcp://HOST:PORT"),
    (["127.0.0.1:5720", "--tokens-file", "{missing}"], "--tokens-file: cannot read"),
    (["127.0.0.1:5720", "--tokens-file", "{not_json}"], "is not JSON"),
    (["127.0.0.1:5720", "--tokens-file", "{not_list}"], "unknown key 'ids'"),
    (["127.0.0.1:5720", "--tokens-file", "{number}"], "must hold a JSON list"),
    (["127.0.0.1:5720", "--tokens-file", "{negative}"], "$.token_ids[1]"),
    (["127.0.0.1:5720", "--tokens-file", "{tokens}", "--deadline", "-1"], "$.deadline_s"),
    (["127.0.0.1:5720", "--tokens-file", "{tokens}", "--timeout", "0"], "timeout_s"),
    (["127.0.0.1:5720", "--tokens-file", "{tokens}", "--curve-secret-key-file", "{tokens}"], "curve_server_key_file"),
    (["127.0.0.1:5720", "--tokens-file", "{tokens}", "--curve-secret-key-file", "{tokens}",
      "--curve-server-key-file", "{tokens}"], "curve_secret_key_file"),
    (["127.0.0.1:5720"], "the following arguments are required: --tokens-file"),
])
def test_bad_arguments_exit_2_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str],
                                            message: str) -> None:
    files = {"tokens": tokens_file(tmp_path, [1, 2]), "missing": str(tmp_path / "missing.json"),
             "not_json": tokens_file(tmp_path, "[1, 2", "bad.json"),
             "not_list": tokens_file(tmp_path, {"ids": [1]}, "obj.json"),
             "negative": tokens_file(tmp_path, [1, -2], "neg.json"), "number": tokens_file(tmp_path, "7", "n.json")}
    rc = run_warm_cli([arg.format(**files) for arg in argv], out=io.StringIO())
    err = capsys.readouterr().err
    assert rc == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_help_lists_the_exit_statuses(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["warm", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--tokens-file" in out and "exit status:" in out and "no reply" in out
    assert cli.main(["--help"]) == 0
    assert "\n  warm " in capsys.readouterr().out


@pytest.mark.anyio
async def test_the_client_speaks_curve_to_a_curve_endpoint(tmp_path: Path) -> None:
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    server_public, server_secret = zmq.auth.create_certificates(tmp_path, "server")
    client_public, client_secret = zmq.auth.create_certificates(tmp_path, "client")
    (allowed / "client.key").write_bytes(Path(client_public).read_bytes())
    tokens = tokens_file(tmp_path, [1, 2, 3, 4])
    async with serving(FakeEngine(fs_tier_outcome), curve_secret_key_file=server_secret, curve_public_key_file=server_public,
                       curve_allowed_clients_dir=str(allowed)) as endpoint:
        rc, lines = await cli_in_thread(endpoint, "--tokens-file", tokens, "--curve-secret-key-file", client_secret,
                                        "--curve-server-key-file", server_public)
        assert rc == 0 and lines[0]["type"] == "outcome"
        with pytest.raises(WarmupError) as info:  # no client key: refused in the handshake
            await anyio.to_thread.run_sync(lambda: warm(endpoint, [1], timeout_s=0.5))
        assert info.value.code == "no_reply"


def test_warm_checks_its_arguments_before_sending() -> None:
    with pytest.raises(TypeError, match="token_ids"):
        warm("127.0.0.1:1", "abc")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"\$\.token_ids\[0\]"):
        warm("127.0.0.1:1", [True])
    with pytest.raises(ValueError, match="tcp://HOST:PORT"):
        warm("ipc:///tmp/x", [1])
    with pytest.raises(ValueError, match=r"\$\.lora_name"):
        warm("127.0.0.1:1", [1], lora_name="x" * 5000)
    with pytest.raises(ValueError, match="curve_secret_key_file: '/nonexistent' is missing"):
        warm("127.0.0.1:1", [1], curve_secret_key_file="/nonexistent", curve_server_key_file="/nonexistent")
