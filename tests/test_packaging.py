"""Packaging and the `weenv` entry point.

- Every package folder under weenvfs/, format/, tools/ is listed in pyproject.toml and every
  listed package exists (the list is explicit, so a forgotten entry would vanish from wheels).
- A wheel built from a copy of the sources installs into a fresh venv and runs `weenv` from
  there, with the spec shipped as package data.
- `main()` keeps its contract: examples in every --help, one-line errors, exit codes.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import struct
import subprocess
import sys
import sysconfig
import tarfile
import textwrap
import tomllib
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from weenvfs import __version__, cli

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
SETUPTOOLS = PYPROJECT["tool"]["setuptools"]


def package_folder(package: str) -> Path:
    """Folder of a dotted package, by the longest matching `package-dir` prefix."""
    mapping: dict[str, str] = SETUPTOOLS.get("package-dir", {})
    parts = package.split(".")
    for cut in range(len(parts), 0, -1):
        prefix = ".".join(parts[:cut])
        if prefix in mapping:
            return ROOT / mapping[prefix] / Path(*parts[cut:])
    return ROOT / Path(*parts)


def package_folders_on_disk() -> dict[str, Path]:
    """Dotted name -> folder, for every folder with an __init__.py in the code folders."""
    roots = {"weenvfs": "weenvfs", "format": "weenvfs.format", "tools": "weenvfs.tools"}
    found = {}
    for folder, dotted in roots.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            found[".".join([dotted, *rel.parts])] = init.parent
    return found


def test_every_package_folder_is_listed() -> None:
    listed = set(SETUPTOOLS["packages"])
    missing = sorted(set(package_folders_on_disk()) - listed)
    assert not missing, f"add to [tool.setuptools] packages in pyproject.toml: {missing}"


@pytest.mark.parametrize("package", SETUPTOOLS["packages"])
def test_every_listed_package_exists(package: str) -> None:
    init = package_folder(package) / "__init__.py"
    assert init.is_file(), f"{package} is listed in pyproject.toml but {init} does not exist"


def test_package_dir_maps_format_and_tools() -> None:
    assert SETUPTOOLS["package-dir"]["weenvfs.format"] == "format"
    assert SETUPTOOLS["package-dir"]["weenvfs.tools"] == "tools"
    assert PYPROJECT["project"]["scripts"]["weenv"] == "weenvfs.entry:main"


# --- the built wheel ----------------------------------------------------------------------


def _copy_sources(dest: Path) -> None:
    # Build from a copy so the build/ and *.egg-info droppings never touch the work tree.
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for name in ("weenvfs", "format", "tools"):
        shutil.copytree(ROOT / name, dest / name, ignore=ignore)
    shutil.copytree(ROOT / "native", dest / "native", ignore=ignore)
    for name in ("pyproject.toml", "README.md", "setup.py", "MANIFEST.in"):
        shutil.copy2(ROOT / name, dest / name)


def _run(cmd: list[str | Path], **kwargs: object) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [str(c) for c in cmd], capture_output=True, text=True, timeout=600, **kwargs
    )
    assert proc.returncode == 0, f"{cmd} failed ({proc.returncode}):\n{proc.stdout}{proc.stderr}"
    return proc


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = tmp_path_factory.mktemp("src")
    out = tmp_path_factory.mktemp("dist")
    _copy_sources(src)
    _run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", out, src])
    (built,) = out.glob("weenv-*.whl")
    return built


@pytest.fixture(scope="module")
def wheel_venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A fresh venv (no site packages) with only the wheel installed, without dependencies."""
    venv = tmp_path_factory.mktemp("venv")
    _run([sys.executable, "-m", "venv", "--without-pip", venv])
    # The dev venv's pip installs into the new venv, so no ensurepip and no network.
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            venv / "bin" / "python",
            "install",
            "--no-deps",
            "--no-index",
            "--disable-pip-version-check",
            "-q",
            wheel,
        ]
    )
    yield venv


def _wheel_env() -> dict[str, str]:
    # Third-party deps come from the dev venv's site-packages via PYTHONPATH. .pth files are not
    # read from PYTHONPATH entries, so the dev editable install of weenvfs stays invisible.
    env = dict(os.environ)
    env["PYTHONPATH"] = sysconfig.get_paths()["purelib"]
    return env


@pytest.mark.slow
def test_wheel_contents(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    for package in SETUPTOOLS["packages"]:
        init = package.replace(".", "/") + "/__init__.py"
        assert init in names, f"{init} missing from {wheel.name}"
    assert "weenvfs/format/errors.py" in names
    assert "weenvfs/cli.py" in names
    if (ROOT / "format" / "SPEC.md").exists():
        assert "weenvfs/format/SPEC.md" in names
    for vector in (ROOT / "format" / "vectors").rglob("*"):
        if vector.is_file() and "__pycache__" not in vector.parts and vector.suffix != ".pyc":
            rel = vector.relative_to(ROOT / "format").as_posix()
            assert f"weenvfs/format/{rel}" in names, f"{rel} missing from {wheel.name}"


@pytest.mark.slow
def test_wheel_runs_from_fresh_venv(wheel_venv: Path, tmp_path: Path) -> None:
    python = wheel_venv / "bin" / "python"
    env = _wheel_env()
    # cwd outside the repo: otherwise `python -c` would import weenvfs/ from the work tree.
    proc = _run([python, "-c", "import weenvfs; print(weenvfs.__file__)"], env=env, cwd=tmp_path)
    assert Path(proc.stdout.strip()).resolve().is_relative_to(wheel_venv.resolve())
    packages = ", ".join(SETUPTOOLS["packages"])
    _run(
        [
            python,
            "-c",
            f"import importlib; [importlib.import_module(p) for p in '{packages}'.split(', ')]",
        ],
        env=env,
        cwd=tmp_path,
    )
    proc = _run([wheel_venv / "bin" / "weenv", "--help"], env=env, cwd=tmp_path)
    assert "examples:" in proc.stdout
    proc = _run([python, "-m", "weenvfs", "version"], env=env, cwd=tmp_path)
    assert proc.stdout.strip() == f"weenv {__version__}"


@pytest.mark.slow
def test_the_wheel_carries_the_native_device_server(wheel: Path, wheel_venv: Path,
                                                    tmp_path: Path) -> None:
    """setup.py compiles native/weenv-devserve.c into the wheel (tagged for this platform),
    installed executable, and mounts from that install find it (`choose_server`)."""
    assert not wheel.name.endswith("-none-any.whl"), wheel.name  # not a pure wheel
    assert "weenvfs/_native/weenv-devserve" in zipfile.ZipFile(wheel).namelist()
    proc = _run([wheel_venv / "bin" / "python", "-c",
                 "from weenvfs.fuse.native_devices import choose_server; print(*choose_server())"],
                env=_wheel_env(), cwd=tmp_path)
    found, why = proc.stdout.split()
    assert why == "None" and Path(found).resolve().is_relative_to(wheel_venv.resolve())
    assert os.access(found, os.X_OK)
    usage = subprocess.run([found], capture_output=True, text=True, timeout=30, check=False)
    assert usage.returncode != 0 and "usage" in usage.stderr.lower(), usage.stderr
    # Built to fetch chunks itself, as setup.sh builds it (native/decode-flags.sh: zstd and
    # BLAKE3's C sources are on this machine, which scripts/setup.sh installs).
    assert b"blake3_hasher_init" in Path(found).read_bytes()


@pytest.mark.slow
def test_the_wheel_carries_the_cgroup_view_crun_runs_in(wheel: Path, wheel_venv: Path,
                                                        tmp_path: Path) -> None:
    """setup.py compiles native/weenv-cgroup-view.c into the wheel too, and code from that
    install finds it (`native_programs.find`)."""
    found = _found_in_wheel("weenv-cgroup-view", wheel, wheel_venv, tmp_path)
    usage = subprocess.run([found], capture_output=True, text=True, timeout=30, check=False)
    assert usage.returncode == 125 and "usage" in usage.stderr.lower(), usage.stderr


@pytest.mark.slow
def test_the_wheel_carries_the_standby_init_statically_linked(wheel: Path, wheel_venv: Path,
                                                               tmp_path: Path) -> None:
    """setup.py compiles native/weenv-standby.c into the wheel, statically (it runs inside
    any image), and code from that install finds it; started without its listening socket
    it refuses in one line with 125."""
    found = _found_in_wheel("weenv-standby", wheel, wheel_venv, tmp_path)
    assert not _has_interpreter(Path(found))  # no dynamic loader: static
    refused = subprocess.run([found], stdin=subprocess.DEVNULL, capture_output=True, text=True,
                             timeout=30, check=False)
    assert refused.returncode == 125
    assert refused.stderr == "weenv-standby: stdin is not a listening socket\n"


def _found_in_wheel(name: str, wheel: Path, wheel_venv: Path, tmp_path: Path) -> str:
    """Native program `name` is in the wheel, and code from its install finds it there
    (`native_programs.find`): its path."""
    assert f"weenvfs/_native/{name}" in zipfile.ZipFile(wheel).namelist()
    proc = _run([wheel_venv / "bin" / "python", "-c",
                 f"from weenvfs import native_programs; print(native_programs.find({name!r}))"],
                env=_wheel_env(), cwd=tmp_path)
    found = proc.stdout.strip()
    assert Path(found).resolve().is_relative_to(wheel_venv.resolve()), found
    return found


def _has_interpreter(program: Path) -> bool:
    """Whether an ELF64 little-endian `program` names a dynamic loader (a PT_INTERP header)."""
    data = program.read_bytes()
    assert data[:6] == b"\x7fELF\x02\x01", "not a 64-bit little-endian ELF file"
    offset, = struct.unpack_from("<Q", data, 0x20)
    size, count = struct.unpack_from("<HH", data, 0x36)
    kinds = [struct.unpack_from("<I", data, offset + i * size)[0] for i in range(count)]
    return 3 in kinds  # PT_INTERP


@pytest.mark.slow
def test_the_sdist_carries_the_server_s_source(tmp_path: Path) -> None:
    """An sdist holds what its wheel build compiles."""
    src = tmp_path / "src"
    src.mkdir()
    _copy_sources(src)
    _run([sys.executable, "-m", "build", "--sdist", "--no-isolation", "--outdir", tmp_path, src])
    (sdist,) = tmp_path.glob("weenv-*.tar.gz")
    with tarfile.open(sdist) as archive:
        names = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    assert {"native/weenv-devserve.c", "native/weenv-launch.c", "native/weenv-cgroup-view.c",
            "native/weenv-standby.c", "native/decode-flags.sh", "setup.py"} <= names


# --- the entry point contract ---------------------------------------------------------------

FAKE_COMMANDS = textwrap.dedent(
    '''
    """Commands that fail in each way main() must translate."""
    from weenvfs.cli import add_command
    from weenvfs.errors import WeenvError, UsageError
    from weenvfs.format.errors import FormatError

    def _raise(exc):
        def handler(args):
            raise exc
        return handler

    FAILURES = {
        "user": WeenvError("the store\\nis gone"),
        "usage": UsageError("bad --flag"),
        "format": FormatError("index header", "bad magic"),
        "internal": RuntimeError("boom\\nagain"),
        "interrupt": KeyboardInterrupt(),
        "path": NotADirectoryError(20, "Not a directory", "/srv/cache"),
        "exists": FileExistsError(17, "File exists", "/srv/cache"),
        "oserror": OSError(5, "Input/output error"),
    }

    def _warn(args):
        import logging
        logging.getLogger("weenvfs.fake").warning("careful: %s", "this")
        return 0

    def register(subparsers):
        add_command(subparsers, "warn", help="warn", description="Warn.",
                    examples=["weenv warn"], func=_warn)
        for name, exc in FAILURES.items():
            p = add_command(subparsers, "fail-" + name, help="fail", description="Fail.",
                            examples=["weenv fail-" + name], func=_raise(exc))
            p.add_argument("--json", action="store_true")
        group = add_command(subparsers, "group", help="a group", description="A group.",
                            examples=["weenv group leaf"], func=None)
        leaves = group.add_subparsers(title="subcommands", metavar="SUBCOMMAND")
        add_command(leaves, "leaf", help="a leaf", description="A leaf.",
                    examples=["weenv group leaf"], func=lambda args: 3)
    '''
)


@pytest.fixture
def fake_commands(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Register a real command module (in front of the real main) whose commands fail."""
    (tmp_path / "weenv_fake_commands.py").write_text(FAKE_COMMANDS, encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(cli, "COMMAND_MODULES", (*cli.COMMAND_MODULES, "weenv_fake_commands"))


def _subcommand_paths(parser: argparse.ArgumentParser, prefix: list[str]) -> Iterator[list[str]]:
    yield prefix
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _subcommand_paths(sub, [*prefix, name])


def test_every_help_shows_examples(fake_commands: None, capsys: pytest.CaptureFixture[str]) -> None:
    paths = list(_subcommand_paths(cli.build_parser(), []))
    assert ["version"] in paths and ["group", "leaf"] in paths
    for path in paths:
        assert cli.main([*path, "--help"]) == 0
        out = capsys.readouterr().out
        assert "\nexamples:\n  weenv" in out, f"weenv {' '.join(path)} --help lacks examples"


@pytest.mark.parametrize(
    ("command", "code", "line"),
    [
        ("fail-user", 1, "weenv: error: the store is gone"),
        ("fail-usage", 2, "weenv: error: bad --flag"),
        ("fail-format", 1, "weenv: error: index header: bad magic"),
        (
            "fail-internal",
            70,
            "weenv: internal error: RuntimeError: boom again (run with --debug for the traceback)",
        ),
        ("fail-interrupt", 130, "weenv: interrupted"),
        # A path of the caller's or the node's that cannot be used is theirs to fix.
        ("fail-path", 1, "weenv: error: /srv/cache: not a directory"),
        ("fail-exists", 1, "weenv: error: /srv/cache: exists and is not a folder"),
        ("fail-oserror", 70, "weenv: internal error: OSError: [Errno 5] Input/output error "
                             "(run with --debug for the traceback)"),
    ],
)
def test_errors_are_one_line(
    fake_commands: None, capsys: pytest.CaptureFixture[str], command: str, code: int, line: str
) -> None:
    assert cli.main([command]) == code
    captured = capsys.readouterr()
    assert captured.err == line + "\n"
    assert captured.out == ""


@pytest.mark.parametrize(("command", "code"), [("fail-user", 1), ("fail-internal", 70),
                                               ("fail-interrupt", 130), ("fail-path", 1)])
def test_with_json_a_failure_is_also_a_json_line_on_stdout(
    fake_commands: None, capsys: pytest.CaptureFixture[str], command: str, code: int
) -> None:
    """A script that reads `--json` output finds the failure there; people still read it on
    stderr."""
    assert cli.main([command, "--json"]) == code
    captured = capsys.readouterr()
    (line,) = captured.err.splitlines()
    assert json.loads(captured.out) == {"error": line.removeprefix("weenv: ").removeprefix(
        "error: "), "exit_code": code}
    assert captured.out.count("\n") == 1


def test_warnings_are_said_as_the_commands_own_lines(
    fake_commands: None, capsys: pytest.CaptureFixture[str], assert_logs: Any
) -> None:
    with assert_logs("careful", count=2):
        assert cli.main(["warn"]) == 0
        assert capsys.readouterr().err == "weenv: warning: careful: this\n"
        assert cli.main(["-v", "warn"]) == 0  # with -v, as a log: level and logger
        assert capsys.readouterr().err == "WARNING weenvfs.fake: careful: this\n"


def test_debug_shows_traceback(fake_commands: None, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--debug", "fail-internal"]) == 70
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err
    assert err.endswith("(run with --debug for the traceback)\n")


def test_exit_codes_of_handlers_and_usage(
    fake_commands: None, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["group", "leaf"]) == 3
    assert cli.main(["group"]) == 2
    assert cli.main([]) == 2
    assert cli.main(["no-such-command"]) == 2
    assert cli.main(["version"]) == 0
    assert capsys.readouterr().out == f"weenv {__version__}\n"


def test_log_file_and_logging_restored(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = logging.getLogger()
    before = (list(root.handlers), root.level, logging.getLogger("weenvfs").level)
    log_file = tmp_path / "weenv.log"
    assert cli.main(["-vv", "--log-file", str(log_file), "version"]) == 0
    assert log_file.exists()
    after = (list(root.handlers), root.level, logging.getLogger("weenvfs").level)
    assert after == before
    assert cli.main(["--log-file", str(tmp_path / "no" / "such" / "dir.log"), "version"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("weenv: error: cannot open log file") and err.count("\n") == 1


def test_add_command_requires_examples() -> None:
    subparsers = argparse.ArgumentParser().add_subparsers()
    with pytest.raises(ValueError, match="example"):
        cli.add_command(subparsers, "x", help="x", description="x", examples=[], func=None)
