"""What a user does after ``pip install "kvik[cpu,server]"``: run with the Python of the venv the
wheels were installed into (``nox -s wheels``), from outside the source tree.

The C++ ops build from the installed sources, ``kvik generate`` answers, and ``kvik serve`` starts,
turns healthy, answers one chat request and stops on SIGTERM. float32: its greedy answer to the
question is Paris on every CPU path, so a wrong answer means a broken install, not a near-tie.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.error
import urllib.request
from pathlib import Path

QUESTION = "What is the capital of France?"
ENGINE = ["--dtype", "float32", "--max-model-len", "512", "--enforce-eager"]
KVIK = str(Path(sys.executable).with_name("kvik"))


def check_installed_not_source_tree() -> None:
    import kvik
    import kvik_cpu
    import kvik_server

    site = Path(sysconfig.get_paths()["purelib"]).resolve()
    for module in (kvik, kvik_cpu, kvik_server):
        where = Path(module.__file__).resolve()
        assert site in where.parents, f"{module.__name__} comes from {where}, not from {site}"


def check_cpp_ops_build() -> None:
    from kvik_cpu import extension

    start = time.monotonic()
    reason = extension.load()
    assert reason is None, f"kvik_cpu's C++ ops did not build from the wheel: {reason}"
    print(f"kvik_cpu's C++ ops built or loaded in {time.monotonic() - start:.0f} s")


def check_generate() -> None:
    args = [KVIK, "generate", QUESTION, *ENGINE, "--max-tokens", "24", "--temperature", "0"]
    done = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"kvik generate exited with {done.returncode}:\n{done.stderr}"
    assert "Paris" in done.stdout, f"kvik generate answered {done.stdout!r}"
    print(f"kvik generate: {done.stdout.strip()!r}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, server: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise AssertionError(f"kvik serve exited with {server.returncode} before /health")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    raise AssertionError(f"kvik serve was not healthy within {timeout_s:.0f} s")


def chat(url: str) -> str:
    body = {
        "model": "smollm2-135m-instruct",
        "messages": [{"role": "user", "content": QUESTION}],
        "max_tokens": 24,
        "temperature": 0,
    }
    request = urllib.request.Request(
        f"{url}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.load(response)["choices"][0]["message"]["content"]


def check_serve() -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([KVIK, "serve", "--port", str(port), *ENGINE])
    try:
        wait_healthy(url, server, timeout_s=600)
        answer = chat(url)
        assert "Paris" in answer, f"kvik serve answered {answer!r}"
        print(f"kvik serve: {answer!r}")
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            raise AssertionError("kvik serve did not stop within 60 s of SIGTERM") from None


def main() -> int:
    check_installed_not_source_tree()
    check_cpp_ops_build()
    check_generate()
    check_serve()
    print("the installed wheels work")
    return 0


if __name__ == "__main__":
    sys.exit(main())
