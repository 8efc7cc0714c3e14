"""A wheelhouse for a GPU host without a package index.

It holds decodescope's wheel and every wheel it needs that the host lacks.
The wheels are for the host's Python and platform.
The wheelhouse is built here, with pip.

On the host, install into an environment of its own:
    pip install --no-index --find-links WHEELHOUSE decodescope
Or install beside the host's own torch (and a vLLM bundle) on PYTHONPATH:
    pip install --no-index --no-deps --target SITE WHEELHOUSE/*.whl && export PYTHONPATH=SITE:$PYTHONPATH

Resolution is pip's own (`pip install --dry-run --report` for the target interpreter).
The host's packages are its constraints, so what is resolved fits what is there.
The host's packages are then left out of the downloads.
Only wheels: the host may have no compiler.
"""
from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Optional

from decodescope.core.io import write_text_atomic

log = logging.getLogger(__name__)

# pip matches each manylinux tag exactly; these cover glibc 2.17 (CentOS 7) to 2.39 (Ubuntu 24.04).
MANYLINUX_X86_64 = tuple(f"manylinux_2_{n}_x86_64" for n in range(39, 16, -1)) + ("manylinux2014_x86_64",
                                                                                  "manylinux1_x86_64")
_REQ_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


class WheelhouseError(RuntimeError):
    pass


@dataclass(frozen=True)
class Target:
    """The host's interpreter: None for each field means this machine's own."""
    python_version: Optional[str] = None     # "3.12"
    platforms: tuple[str, ...] = ()          # pip --platform tags, e.g. MANYLINUX_X86_64
    implementation: str = "cp"

    def pip_args(self) -> list[str]:
        if self.python_version is None and not self.platforms:
            return ["--only-binary=:all:"]
        args = ["--only-binary=:all:", "--implementation", self.implementation]
        if self.python_version:
            args += ["--python-version", self.python_version]
        for p in self.platforms:
            args += ["--platform", p]
        return args


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_host_packages(path: Path) -> dict[str, Optional[str]]:
    """`pip list --format=freeze` (or `pip freeze`) of the host: {canonical name: version or None}.
    Lines without a version (a plain name) say the host has it, at whatever version."""
    have: dict[str, Optional[str]] = {}
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line or line.startswith("-"):
            continue
        m = _REQ_NAME.match(line)
        if not m:
            raise WheelhouseError(f"{path}:{n}: {line!r} is not a package line like 'torch==2.11.0' or 'torch'")
        name = canonical(m.group(1))
        rest = line[m.end():].strip()
        if " @ " in line or rest.startswith("@"):
            have[name] = None            # installed from a URL or a path: keep it, pin nothing
        elif rest.startswith("=="):
            have[name] = rest[2:].split(";")[0].strip()
        elif rest == "":
            have[name] = None
        else:
            raise WheelhouseError(f"{path}:{n}: {line!r}: give an exact version (name==1.2.3) or the name alone")
    return have


def constraints_text(have: dict[str, Optional[str]]) -> str:
    return "".join(f"{name}=={version}\n" for name, version in sorted(have.items()) if version)


def to_download(report: dict, have: dict[str, Optional[str]], skip: set[str]) -> list[tuple[str, str]]:
    """(name, version) of each resolved wheel the host lacks, from pip's installation report."""
    out = []
    for item in report.get("install", []):
        meta = item["metadata"]
        name = canonical(meta["name"])
        if name in have or name in skip:
            continue
        out.append((name, meta["version"]))
    return sorted(out)


def _pip(args: list[str], what: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise WheelhouseError(f"pip {what} failed (exit {proc.returncode}):\n{proc.stderr.strip()[-3000:]}")
    return proc


def _version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", text)[:3])


def local_build_gap() -> Optional[str]:
    """Why this interpreter cannot build decodescope's wheel from its own setuptools (pyproject.toml's
    setuptools>=64, and bdist_wheel: setuptools 70.1+ carries it, older ones need the `wheel` package), or
    None when it can."""
    try:
        setuptools = metadata.version("setuptools")
    except metadata.PackageNotFoundError:
        return "no setuptools"
    if _version_tuple(setuptools) < (64,):
        return f"setuptools {setuptools} (pyproject.toml asks for >=64)"
    if _version_tuple(setuptools) >= (70, 1):
        return None
    try:
        metadata.version("wheel")
        return None
    except metadata.PackageNotFoundError:
        return f"setuptools {setuptools} without the wheel package (no bdist_wheel command)"


def check_pip() -> None:
    """Before anything: pip is what builds, resolves and downloads; say so when this Python has none."""
    proc = subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True, text=True)
    if proc.returncode != 0:
        raise WheelhouseError(f"{sys.executable} has no pip (`{sys.executable} -m pip` failed); the wheelhouse is "
                              f"built with pip: install it (`{sys.executable} -m ensurepip`) or run decodescope "
                              "wheelhouse from a Python that has it")


def build_wheel(project_dir: Path, out_dir: Path) -> Path:
    """decodescope's own wheel from its source tree: with this Python's setuptools where it can build one
    (no build isolation, nothing fetched), else in pip's isolated build environment, with setuptools and
    wheel fetched from the index the wheelhouse downloads from anyway."""
    if not (Path(project_dir) / "pyproject.toml").is_file():
        raise WheelhouseError(f"{project_dir} has no pyproject.toml: give --project the decodescope source tree")
    for old in Path(out_dir).glob("decodescope-*.whl"):
        old.unlink()
    gap = local_build_gap()
    args = ["wheel", "--no-deps", "-q", "-w", str(out_dir), str(project_dir)]
    if gap is None:
        _pip(args[:2] + ["--no-build-isolation"] + args[2:], "wheel")
    else:
        log.info("this Python has %s: decodescope's wheel is built in pip's isolated build environment "
                 "(setuptools and wheel from the index)", gap)
        try:
            _pip(args, "wheel")
        except WheelhouseError as e:
            raise WheelhouseError(f"{sys.executable} has {gap}, and pip could not fetch setuptools>=64 and wheel "
                                  f"for an isolated build: install them here (`{sys.executable} -m pip install "
                                  f"'setuptools>=70.1'`) or give pip an index.\n{e}") from None
    wheels = sorted(Path(out_dir).glob("decodescope-*.whl"))
    if len(wheels) != 1:
        raise WheelhouseError(f"expected one decodescope wheel in {out_dir}, found {[w.name for w in wheels]}")
    return wheels[0]


def resolve(requirement: str, target: Target, constraints: Optional[Path], work_dir: Path) -> dict:
    """pip's installation report for `requirement` on the target interpreter, nothing installed."""
    report_path = work_dir / "pip-report.json"
    args = ["install", "--dry-run", "--ignore-installed", "--quiet", "--report", str(report_path),
            "--target", str(work_dir / "never-written"), *target.pip_args()]
    if constraints is not None:
        args += ["-c", str(constraints)]
    _pip(args + [requirement], "resolve")
    return json.loads(report_path.read_text())


def download(wheels: list[tuple[str, str]], target: Target, out_dir: Path) -> None:
    specs = [f"{name}=={version}" for name, version in wheels]
    if specs:
        _pip(["download", "--no-deps", "-q", "-d", str(out_dir), *target.pip_args(), *specs], "download")


def build(out_dir: Path, project_dir: Path, extras: tuple[str, ...] = (), target: Target = Target(),
          host_packages: Optional[Path] = None, skip: tuple[str, ...] = ()) -> dict:
    """Write the wheelhouse into out_dir; return what it holds and what it left to the host."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    have = read_host_packages(host_packages) if host_packages else {}
    skip_set = {canonical(s) for s in skip}
    check_pip()
    own = build_wheel(project_dir, out_dir)
    constraints = None
    if have:
        constraints = out_dir / "host-constraints.txt"
        write_text_atomic(constraints, constraints_text(have))
    # the wheel's own path, so that no package of the same name on the index stands in for it
    requirement = f"{own}[{','.join(extras)}]" if extras else str(own)
    report = resolve(requirement, target, constraints, out_dir)
    wheels = to_download(report, have, skip_set | {"decodescope"})
    download(wheels, target, out_dir)
    resolved = {canonical(i["metadata"]["name"]) for i in report.get("install", [])}
    manifest = {"decodescope_wheel": own.name, "extras": list(extras),
                "python_version": target.python_version, "platforms": list(target.platforms),
                "downloaded": [f"{n}=={v}" for n, v in wheels],
                "left_to_host": sorted(resolved & (set(have) | skip_set))}
    write_text_atomic(out_dir / "wheelhouse.json", json.dumps(manifest, indent=1) + "\n")
    return manifest
