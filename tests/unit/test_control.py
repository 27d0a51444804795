"""The agent's control socket: where it lives, and that it leaves nothing behind."""

from __future__ import annotations

import asyncio
import os
import stat
import tempfile
from pathlib import Path
from typing import Any

import pytest

from rlaunch.agent.control import ControlServer
from rlaunch.runtime.agent_link import AgentLink, AgentLinkError


def test_the_socket_lives_in_a_private_directory_only_while_it_serves() -> None:
    async def go() -> None:
        server = ControlServer()
        with pytest.raises(RuntimeError, match="before the server starts"):
            _ = server.path

        async def echo(request: dict[str, Any]) -> dict[str, Any]:
            return {"seen": request["value"]}

        server.register("echo", echo)
        await server.start()
        folder = os.path.dirname(server.path)
        try:
            assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700  # nobody else can reach the socket
            link = AgentLink(server.path, 0)
            assert await asyncio.to_thread(link.call, "echo", value=3) == {"seen": 3}
            with pytest.raises(AgentLinkError, match="does not know the request 'nope'"):
                await asyncio.to_thread(link.call, "nope")
        finally:
            await server.close()
        assert not os.path.exists(folder)

    asyncio.run(go())


def test_nothing_is_made_before_the_server_starts_nor_left_when_its_start_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where mkdtemp makes the socket's directory
    never_started = ControlServer()
    assert os.listdir(tmp_path) == []
    asyncio.run(never_started.close())

    async def refused(*args: Any, **kwargs: Any) -> None:
        raise OSError("no socket here")

    monkeypatch.setattr(asyncio, "start_unix_server", refused)
    failed = ControlServer()

    async def go() -> None:
        try:
            with pytest.raises(OSError, match="no socket here"):
                await failed.start()
        finally:
            await failed.close()

    asyncio.run(go())
    assert os.listdir(tmp_path) == []
