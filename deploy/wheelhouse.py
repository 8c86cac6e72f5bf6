"""``flotilla deploy wheelhouse``: every wheel an air-gapped machine needs to install flotilla.

    flotilla deploy wheelhouse DIR [--extra gpu]... [--python-version 3.12]
                                   [--platform manylinux_2_28_x86_64] [--find-links D]...
                                   [--no-index] [--constraint FILE]... [--extra-index-url URL]...
                                   [--project SRC]

Three pip steps, each named in the error when it fails:

1. build flotilla's own wheel from its source checkout (``pip wheel SRC --no-deps``);
2. download every dependency of ``flotilla[EXTRAS]`` (pyproject's pins, the extras,
   ``--constraint`` files) as wheels only (``pip download --only-binary=:all:``), for the
   target interpreter and platform, into DIR;
3. check that it installs from DIR alone (``pip install --dry-run --no-index
   --find-links DIR flotilla[EXTRAS]==VERSION``) and write what that resolved, pinned, to
   ``DIR/requirements.txt``.

On the target machine::

    pip install --no-index --find-links DIR -r DIR/requirements.txt

NOTE: pip evaluates environment markers (``python_version``, ``platform_machine``, ...)
for the interpreter running it, not for ``--python-version``/``--platform``; build the
wheelhouse with an interpreter of the target's Python version, OS and architecture
(a note is printed when they differ).
"""

from __future__ import annotations

import json
import platform as host
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from flotilla.resolution import ArgumentError
from flotilla.resolution.args import _Parser

# glibc 2.28 or later (RHEL 8, Ubuntu 20.04, Debian 10 on): the tag torch's Linux wheels carry.
DEFAULT_PLATFORM = "manylinux_2_28_x86_64"
REQUIREMENTS_FILE = "requirements.txt"
# Lines of pip's output an error message quotes.
ERROR_TAIL_LINES = 15

_EXTRA = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?$")
_PYTHON_VERSION = re.compile(r"^3\.\d{1,2}$")
_PLATFORM_TAG = re.compile(r"^[a-z0-9_.]+$")
_NO_MATCH = re.compile(r"No matching distribution found for (\S+)")


class WheelhouseError(RuntimeError):
    """A step of building the wheelhouse failed; the message names the step, the command
    and pip's last lines."""


@dataclass(frozen=True)
class WheelhouseOptions:
    """Which wheels, for which machine, from where.

    Attributes:
        extras: extras of the wrapped project to include (``("gpu",)``).
        python_version: the target interpreter as ``"3.N"`` (None: the one running this).
        platform: the target platform tag, e.g. ``manylinux_2_28_x86_64`` (None: this machine).
        find_links: more local folders (or URLs) of wheels, searched with the index.
        no_index: never ask an index: every wheel must come from ``find_links`` (offline).
            The project's wheel is then built without build isolation, with the build
            backend of the running environment.
        constraints: pip constraint files (``-c``), e.g. pinning torch to the image's CUDA build.
        extra_index_urls: more indexes, e.g. PyTorch's own for a given CUDA version.

    A bad value raises :class:`ArgumentError` naming the command's flag and the value.
    """

    extras: tuple[str, ...] = ()
    python_version: str | None = None
    platform: str | None = None
    find_links: tuple[str, ...] = ()
    no_index: bool = False
    constraints: tuple[str, ...] = ()
    extra_index_urls: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for extra in self.extras:
            if not _EXTRA.match(extra):
                raise ArgumentError(f"--extra {extra!r} is not an extra's name (letters, digits, '.', '_', '-')")
        if self.python_version is not None and not _PYTHON_VERSION.match(self.python_version):
            raise ArgumentError(f"--python-version expects 3.N, e.g. 3.12 (got {self.python_version!r})")
        if self.platform is not None and not _PLATFORM_TAG.match(self.platform):
            raise ArgumentError(
                f"--platform expects a wheel platform tag such as {DEFAULT_PLATFORM} (got {self.platform!r})"
            )
        if self.no_index and not self.find_links:
            raise ArgumentError(
                "--no-index needs at least one --find-links D: with no index, the wheels come from there"
            )
        for links in self.find_links:
            if "://" not in links and not Path(links).is_dir():
                raise ArgumentError(f"--find-links {links}: no such folder")
        for constraint in self.constraints:
            if not Path(constraint).is_file():
                raise ArgumentError(f"--constraint {constraint}: no such file")


@dataclass(frozen=True)
class Wheelhouse:
    """What :func:`build_wheelhouse` produced.

    Attributes:
        path: the folder holding the wheels and ``requirements.txt``.
        project_wheel: the wrapped project's own wheel in it.
        requirement: what the target installs, e.g. ``flotilla[gpu]==0.1.0``.
        pins: ``name==version`` of every distribution that installs: the requirement
            first, then the rest by name (the lines of ``requirements.txt``).
    """

    path: Path
    project_wheel: Path
    requirement: str
    pins: tuple[str, ...]

    @property
    def requirements_file(self) -> Path:
        """The pins, as a file ``pip install -r`` takes."""
        return self.path / REQUIREMENTS_FILE


Log = Callable[[str], None]


def build_wheelhouse(
    dest: str | Path, project: str | Path, options: WheelhouseOptions, log: Log | None = None
) -> Wheelhouse:
    """Fill ``dest`` with the wheel of the project at ``project`` (a folder with a
    ``pyproject.toml``) and every wheel its requirement with ``options.extras`` needs on
    the target, check that it installs with ``--no-index`` from ``dest`` alone, and write
    ``dest/requirements.txt``. ``log`` receives pip's output line by line (None: quiet).
    Raises :class:`WheelhouseError` naming the step that failed."""
    dest = Path(dest).resolve()
    project = Path(project).resolve()
    if not (project / "pyproject.toml").is_file():
        raise WheelhouseError(f"project {project} has no pyproject.toml: pass the folder of a source checkout")
    if dest.exists() and not dest.is_dir():
        raise WheelhouseError(f"wheelhouse {dest} exists and is not a folder")
    dest.mkdir(parents=True, exist_ok=True)
    note = marker_mismatch(options)
    if note and log:
        log(f"note: {note}")
    wheel = build_project_wheel(project, dest, options, log)
    name, version, provided = wheel_metadata(wheel)
    missing = [e for e in options.extras if _normal(e) not in provided]
    if missing:
        raise WheelhouseError(
            f"{name} {version} has no extra {', '.join(missing)} (it provides: {', '.join(sorted(provided)) or 'none'})"
        )
    extras = f"[{','.join(options.extras)}]" if options.extras else ""
    download_dependencies(f"{name}{extras} @ {wheel.as_uri()}", dest, options, log)
    requirement = f"{name}{extras}=={version}"
    resolved = offline_resolution(requirement, dest, options, log)
    pins = [requirement] + [f"{n}=={v}" for n, v in resolved if _normal(n) != _normal(name)]
    write_requirements(dest, pins, options)
    return Wheelhouse(path=dest, project_wheel=wheel, requirement=requirement, pins=tuple(pins))


def build_project_wheel(project: Path, dest: Path, options: WheelhouseOptions, log: Log | None = None) -> Path:
    """Step 1: ``pip wheel PROJECT --no-deps`` into ``dest``; returns the wheel's path."""
    with tempfile.TemporaryDirectory(prefix="flotilla-wheel-") as out:
        args = ["wheel", str(project), "--no-deps", "--wheel-dir", out]
        if options.no_index:
            # NOTE: an isolated build would fetch the build backend from an index.
            args += ["--no-build-isolation", "--no-index"]
        _pip(args, f"building the wheel of {project}", log)
        built = sorted(Path(out).glob("*.whl"))
        if len(built) != 1:
            names = [p.name for p in built]
            raise WheelhouseError(f"building the wheel of {project}: expected one wheel, pip wrote {names}")
        target = dest / built[0].name
        shutil.move(str(built[0]), target)
    return target


def download_dependencies(requirement: str, dest: Path, options: WheelhouseOptions, log: Log | None = None) -> None:
    """Step 2: ``pip download --only-binary=:all:`` of ``requirement`` and everything it
    needs on the target into ``dest`` (wheels already there are reused)."""
    args = ["download", requirement, "--dest", str(dest), *_source_args(options, dest), *_target_args(options)]
    args += [arg for path in options.constraints for arg in ("--constraint", path)]
    _pip(args, f"downloading the dependencies of {requirement.split(' @ ')[0]}", log)


def offline_resolution(
    requirement: str, dest: Path, options: WheelhouseOptions, log: Log | None = None
) -> list[tuple[str, str]]:
    """Step 3: resolve ``requirement`` as the target would, from ``dest`` alone and
    without an index (``pip install --dry-run --report``); returns (name, version) of
    every distribution it installs, by name."""
    with tempfile.TemporaryDirectory(prefix="flotilla-report-") as tmp:
        report = Path(tmp) / "report.json"
        args = ["install", requirement, "--dry-run", "--ignore-installed", "--no-index", "--find-links", str(dest)]
        args += [*_target_args(options), "--report", str(report)]
        _pip(args, f"checking that {requirement} installs offline from {dest}", log)
        installs = json.loads(report.read_text())["install"]
    found = [(item["metadata"]["name"], item["metadata"]["version"]) for item in installs]
    return sorted(found, key=lambda pin: _normal(pin[0]))


def write_requirements(dest: Path, pins: Sequence[str], options: WheelhouseOptions) -> Path:
    """``dest/requirements.txt``: ``pins`` (the project's first, with its extras) under a
    header saying what they are for and how to install them."""
    target = f"Python {options.python_version or _this_python()} on {options.platform or 'this machine'}"
    header = [
        f"# The offline wheelhouse of {pins[0]}, resolved for {target}",
        "# by `flotilla deploy wheelhouse`. Install on the target machine with:",
        "#   pip install --no-index --find-links <this folder> -r <this folder>/requirements.txt",
    ]
    path = dest / REQUIREMENTS_FILE
    path.write_text("\n".join(header + list(pins)) + "\n")
    return path


def wheel_metadata(wheel: Path) -> tuple[str, str, set[str]]:
    """(name, version, normalised extras provided) read from a wheel's METADATA."""
    with zipfile.ZipFile(wheel) as archive:
        names = [n for n in archive.namelist() if n.count("/") == 1 and n.endswith(".dist-info/METADATA")]
        if not names:
            raise WheelhouseError(f"{wheel.name} has no .dist-info/METADATA: not a wheel")
        text = archive.read(names[0]).decode("utf-8")
    headers: dict[str, list[str]] = {}
    for line in text.split("\n\n", 1)[0].splitlines():
        key, sep, value = line.partition(":")
        if sep and not line.startswith((" ", "\t")):
            headers.setdefault(key.strip().lower(), []).append(value.strip())
    name, version = headers.get("name", [""])[0], headers.get("version", [""])[0]
    return name, version, {_normal(e) for e in headers.get("provides-extra", [])}


def marker_mismatch(options: WheelhouseOptions) -> str | None:
    """Why pip's marker evaluation may not match the target (see the module note), or None."""
    reasons = []
    if options.python_version and options.python_version != _this_python():
        reasons.append(f"the target is Python {options.python_version}, this is Python {_this_python()}")
    if options.platform and not _runs_here(options.platform):
        reasons.append(f"the target platform is {options.platform}, this machine is {sys.platform} {host.machine()}")
    if not reasons:
        return None
    return (
        "; ".join(reasons)
        + ": pip evaluates dependency markers for this interpreter, so a dependency only the target needs may be"
        " missing; build the wheelhouse where Python, OS and architecture match the target"
    )


def _runs_here(tag: str) -> bool:
    """Whether this machine has the OS and architecture platform ``tag`` names."""
    machine = {"amd64": "x86_64", "arm64": "aarch64"}.get(host.machine().lower(), host.machine().lower())
    wanted = tag.replace("arm64", "aarch64").replace("amd64", "x86_64")
    if "linux" in tag:
        same_os = sys.platform.startswith("linux")
    elif tag.startswith("macosx"):
        same_os = sys.platform == "darwin"
    else:
        same_os = tag.startswith("win") and sys.platform == "win32"
    return same_os and wanted.endswith(machine)


def _source_args(options: WheelhouseOptions, dest: Path) -> list[str]:
    args = ["--no-index"] if options.no_index else []
    for links in (str(dest), *options.find_links):
        args += ["--find-links", links]
    for url in options.extra_index_urls:
        args += ["--extra-index-url", url]
    return args


def _target_args(options: WheelhouseOptions) -> list[str]:
    args = ["--only-binary=:all:"]
    if options.python_version:
        args += ["--python-version", options.python_version]
    if options.platform:
        args += ["--platform", options.platform]
    return args


def _pip(args: list[str], step: str, log: Log | None) -> None:
    """Run ``python -m pip ARGS``; WheelhouseError naming ``step`` when it fails."""
    command = [sys.executable, "-m", "pip", args[0], "--disable-pip-version-check", "--no-input"]
    command += ["--progress-bar", "off", *args[1:]]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    tail: list[str] = []
    assert process.stdout is not None
    for line in process.stdout:
        line = line.rstrip("\n")
        tail = (tail + [line])[-ERROR_TAIL_LINES:]
        if log:
            log(line)
    if process.wait() != 0:
        missing = next((m.group(1) for line in tail if (m := _NO_MATCH.search(line))), None)
        hint = ""
        if missing:
            hint = (
                f"\nhint: no wheel of {missing} fits the target; build one (`pip wheel {shlex.quote(missing)}`) "
                "and pass its folder with --find-links, or check --python-version/--platform"
            )
        raise WheelhouseError(
            f"{step} failed (pip exit status {process.returncode}): {shlex.join(command)}\n"
            + "\n".join(f"  | {line}" for line in tail)
            + hint
        )


def _normal(name: str) -> str:
    """A distribution or extra name, normalised (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _this_python() -> str:
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def default_project() -> Path:
    """flotilla's source checkout (the folder of this package's ``pyproject.toml``)."""
    return Path(__file__).resolve().parents[1]


def build_parser() -> _Parser:
    parser = _Parser(
        prog="flotilla deploy wheelhouse",
        add_help=False,
        description="Collect every wheel flotilla needs into DIR, for machines with no network "
        "(then: pip install --no-index --find-links DIR -r DIR/requirements.txt).",
    )
    add = parser.add_argument
    many = dict(action="append", default=[])
    add("--help", "-h", action="help", help="show this help and exit")
    add("dir", metavar="DIR", help="the wheelhouse folder (created; wheels already there are reused)")
    add("--extra", metavar="NAME", help="an extra of flotilla to include, e.g. gpu (repeatable)", **many)
    add(
        "--python-version",
        default=_this_python(),
        metavar="3.N",
        help="the target's Python (default %(default)s, this one; the image in deploy/docker uses 3.12)",
    )
    add("--platform", default=DEFAULT_PLATFORM, metavar="TAG", help="the target platform tag (default %(default)s)")
    add("--find-links", metavar="D", help="a folder (or URL) of wheels to use too (repeatable)", **many)
    add("--no-index", action="store_true", help="use only --find-links folders, never an index")
    add("--constraint", metavar="FILE", help="a pip constraints file, e.g. a torch pin (repeatable)", **many)
    add("--extra-index-url", metavar="URL", help="another index, e.g. PyTorch's (repeatable)", **many)
    add("--project", default=None, metavar="SRC", help="the source checkout to build (default: this flotilla's)")
    return parser


def parse_wheelhouse_args(argv: Sequence[str]) -> tuple[Path, Path, WheelhouseOptions]:
    """(wheelhouse folder, project folder, options); :class:`ArgumentError` on bad input."""
    opts = build_parser().parse_args(list(argv))
    project = Path(opts.project) if opts.project else default_project()
    if not (project / "pyproject.toml").is_file():
        where = f"--project {opts.project}" if opts.project else f"this flotilla's folder {project}"
        raise ArgumentError(f"{where} has no pyproject.toml; pass --project with a flotilla source checkout")
    options = WheelhouseOptions(
        extras=tuple(opts.extra),
        python_version=opts.python_version,
        platform=opts.platform,
        find_links=tuple(opts.find_links),
        no_index=opts.no_index,
        constraints=tuple(opts.constraint),
        extra_index_urls=tuple(opts.extra_index_url),
    )
    return Path(opts.dir), project, options


def run_wheelhouse(argv: Sequence[str]) -> int:
    """Entry of ``flotilla deploy wheelhouse``; returns the exit status (2: bad arguments,
    1: a step failed)."""
    try:
        dest, project, options = parse_wheelhouse_args(argv)
    except ArgumentError as exc:
        print(f"flotilla deploy wheelhouse: error: {exc}", file=sys.stderr)
        return 2

    def log(line: str) -> None:
        print(line, file=sys.stderr)

    try:
        house = build_wheelhouse(dest, project, options, log=log)
    except WheelhouseError as exc:
        print(f"flotilla deploy wheelhouse: error: {exc}", file=sys.stderr)
        return 1
    print(
        f"flotilla deploy wheelhouse: {len(house.pins)} distributions for {house.requirement} in {house.path}\n"
        f"install offline with:\n  pip install --no-index --find-links {house.path} -r {house.requirements_file}"
    )
    return 0
