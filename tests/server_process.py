"""A kvik server in a subprocess on a free port of 127.0.0.1, for the end-to-end server tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, model: Path, *args: str, api_key: str | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        command = [sys.executable, "-m", "kvik_server.cli", str(model), "--port", str(self.port)]
        # Eager: no CUDA graph capture at start-up where a platform has graphs (these tests check
        # behaviour, not speed; on the CPU it changes nothing).
        command += ["--enforce-eager"]
        command += ["--api-key", api_key] if api_key else []
        self.log = open(
            Path(os.environ.get("TMPDIR", "/tmp")) / f"kvik-server-{self.port}.log", "w+"
        )
        self.process = subprocess.Popen(
            [*command, *args], stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def wait_ready(self, timeout_s: float = 180.0) -> ServerProcess:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited:\n{self.output()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise TimeoutError(f"the server did not start:\n{self.output()}")

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()[-5000:]

    def engine_pid(self) -> int:
        """The pid of the server's child process that runs the engine core."""
        pid = self.process.pid
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        for child in children:
            if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes():
                return int(child)
        raise LookupError(f"no engine core process among {children}")

    def metrics(self) -> dict[str, float]:
        text = httpx.get(f"{self.url}/metrics", headers=self.headers, timeout=5).text
        values = {}
        for line in text.splitlines():
            if line.startswith("kvik:") and "_bucket" not in line:
                name, value = line.rsplit(" ", 1)
                values[name.split("{")[0]] = float(value)
        return values

    def stop_and_check(self, timeout_s: float = 30.0) -> None:
        """SIGTERM: the server shuts down gracefully (uvicorn exits with the signal it was
        stopped by) and its engine core process is gone."""
        try:
            engine = self.engine_pid()
        except (LookupError, FileNotFoundError):
            engine = None
        assert self.stop(timeout_s) in (0, -signal.SIGTERM), self.output()
        assert "Application shutdown complete" in self.output()
        if engine is not None:
            assert not Path(f"/proc/{engine}").exists() or _is_zombie(engine)

    def stop(self, timeout_s: float = 30.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z")
    except FileNotFoundError:
        return True
