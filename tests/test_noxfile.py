"""``nox -s serve`` passes a SIGTERM sent to nox on to ``kvik serve`` and waits for it to exit:
nox alone died of the signal and left the server running, its parent gone, port 8000 held. Here
the noxfile's run_until_stopped runs a stand-in server that takes 2 s to shut down (longer than
the 0.5 s nox gives a command by default)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from process_checks import alive

REPO = Path(__file__).resolve().parents[1]

SESSIONS = f"""
import sys
sys.path.insert(0, {str(REPO)!r})
import nox
from noxfile import run_until_stopped

@nox.session(venv_backend="none")
def stand_in(session):
    run_until_stopped(session, {sys.executable!r}, "server.py")
"""

SERVER = """
import os, signal, sys, time

def stop(signum, frame):
    time.sleep(2)  # a graceful shutdown
    open("stopped", "w").write(signal.Signals(signum).name)
    sys.exit(0)

signal.signal(signal.SIGTERM, stop)
open("pid.tmp", "w").write(str(os.getpid()))
os.replace("pid.tmp", "pid")
while True:
    time.sleep(0.1)
"""


def test_sigterm_to_nox_stops_the_server_it_runs(tmp_path):
    pytest.importorskip("nox")
    (tmp_path / "sessions.py").write_text(SESSIONS)
    (tmp_path / "server.py").write_text(SERVER)
    nox_process = subprocess.Popen(
        [sys.executable, "-m", "nox", "-f", "sessions.py", "-s", "stand_in"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "pid").exists():
            assert nox_process.poll() is None, nox_process.stdout.read().decode()
            assert time.monotonic() < deadline, "the stand-in server did not start"
            time.sleep(0.1)
        server = int((tmp_path / "pid").read_text())
        nox_process.send_signal(signal.SIGTERM)
        nox_process.wait(timeout=20)
        assert (tmp_path / "stopped").read_text() == "SIGTERM"
        assert not alive(server)
    finally:
        if nox_process.poll() is None:
            nox_process.kill()
        if (tmp_path / "pid").exists() and alive(pid := int((tmp_path / "pid").read_text())):
            os.kill(pid, signal.SIGKILL)
