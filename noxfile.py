"""Sessions: ``tests`` (the test suite), ``lint`` (ruff), ``env`` (kvik env), ``serve`` (the server)."""

from __future__ import annotations

import glob
import shutil

import nox

nox.options.default_venv_backend = "venv"
nox.options.sessions = ["tests", "lint"]

PACKAGES = ["core", "platform-cpu", "platform-cuda", "platform-rocm", "models", "server"]
# The versions the GPU machine's image has, so that results compare across machines.
PINS = ["triton==3.6.0", "transformers==5.17.0"]


def install_kvik(session: nox.Session, extras: str = "") -> None:
    if shutil.which("nvidia-smi") is None:
        # Asked for by itself first, torch 2.13.0 is the CPU build, not the CUDA one of several GB.
        session.install("torch==2.13.0")
    session.install(*PINS)
    session.install(*(arg for p in PACKAGES for arg in ("-e", f"packages/{p}{extras}")))


@nox.session
def tests(session: nox.Session) -> None:
    install_kvik(session, "[test]")
    # hatchling: tests/test_example_plugin.py builds plugin packages without build isolation.
    session.install("hatchling", "hypothesis", "pytest")
    session.run("pytest", *sorted(glob.glob("packages/*/tests")), "tests", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    session.install("ruff")
    session.run("ruff", "check", ".", *session.posargs)


@nox.session
def env(session: nox.Session) -> None:
    install_kvik(session)
    session.run("kvik", "env", *session.posargs)


@nox.session
def serve(session: nox.Session) -> None:
    """The main job: serve the default model on http://127.0.0.1:8000 (``nox -s serve -- --help``)."""
    install_kvik(session)
    session.run("kvik", "serve", *session.posargs)
