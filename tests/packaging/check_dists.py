"""Every file under each package's src/ is in its wheel and its sdist (``nox -s build``).

Run as ``python tests/packaging/check_dists.py DIST_DIR PACKAGE_DIR...``. The CPU platform's C++
sources (kvik_cpu/csrc) matter most: they are compiled on the user's machine at first use, so a
wheel without them installs fine and only fails when a model runs.
"""

from __future__ import annotations

import re
import sys
import tarfile
import zipfile
from pathlib import Path

SKIPPED_PARTS = {"__pycache__"}


def project(package_dir: Path) -> tuple[str, str]:
    """The (name, version) that pyproject.toml's [project] table gives."""
    text = (package_dir / "pyproject.toml").read_text()
    name = re.search(r'^name = "([^"]+)"', text, re.M).group(1)
    version = re.search(r'^version = "([^"]+)"', text, re.M).group(1)
    return name, version


def source_files(package_dir: Path) -> list[str]:
    src = package_dir / "src"
    return sorted(
        str(p.relative_to(src))
        for p in src.rglob("*")
        if p.is_file() and not SKIPPED_PARTS & set(p.parts) and p.suffix != ".pyc"
    )


def check(dist: Path, package_dir: Path) -> list[str]:
    name, version = project(package_dir)
    stem = f"{name.replace('-', '_')}-{version}"
    wheels = sorted(dist.glob(f"{stem}-*.whl"))
    sdists = sorted(dist.glob(f"{stem}.tar.gz"))
    if len(wheels) != 1 or len(sdists) != 1:
        return [f"{name}: expected one wheel and one sdist in {dist}, found {wheels + sdists}"]
    with zipfile.ZipFile(wheels[0]) as wheel:
        in_wheel = set(wheel.namelist())
    with tarfile.open(sdists[0]) as sdist:
        in_sdist = set(sdist.getnames())
    problems = []
    files = source_files(package_dir)
    for path in files:
        if path not in in_wheel:
            problems.append(f"{wheels[0].name} lacks {path}")
        if f"{stem}/src/{path}" not in in_sdist:
            problems.append(f"{sdists[0].name} lacks src/{path}")
    native = [f for f in files if not f.endswith(".py")]
    print(f"{name}: {len(files)} source files in wheel and sdist, of them not Python: {native}")
    return problems


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    dist = Path(argv[0])
    problems = [p for package_dir in argv[1:] for p in check(dist, Path(package_dir))]
    for problem in problems:
        print(problem, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
