"""The shared command-line shapes of weenvfs/cli_args.py, parsed through the real `weenv`
parser (no command runs): `weenv run`, `weenv hints record` and `weenv sandbox exec` take
`[OPTIONS] REF [COMMAND [ARG...]]` as `docker run` does, and still accept the older
`REF [OPTIONS] -- COMMAND`."""

from __future__ import annotations

import argparse

import pytest

from weenvfs import cli
from weenvfs.cli_args import env_dict, env_pair, non_negative, positive, split_command
from weenvfs.errors import UsageError

SHAPES = [(("run",), "ref"), (("hints", "record"), "ref"), (("sandbox", "exec"), "id")]
# An option each shape takes, and the attribute it sets.
OPTION = {"ref": (["--store", "S"], "store", "S"), "id": (["-w", "/w"], "workdir", "/w")}


def _parse(argv: list[str]) -> argparse.Namespace:
    return cli.build_parser(cli._command_of(argv)).parse_args(argv)


def _split(argv: list[str], name: str) -> tuple[argparse.Namespace, list[str]]:
    args = _parse(argv)
    return args, split_command(args, name, store=hasattr(args, "store"))


@pytest.mark.parametrize(("words", "name"), SHAPES)
@pytest.mark.parametrize(
    "tail",
    [
        ["R", "echo", "hi", "--store", "x"],  # after REF: the command's own arguments
        ["R", "--", "echo", "hi", "--store", "x"],
    ],
)
def test_everything_after_ref_is_the_command(words: tuple[str, ...], name: str,
                                             tail: list[str]) -> None:
    option, attr, value = OPTION[name]
    args, command = _split([*words, *option, *tail], name)
    assert getattr(args, name) == "R"
    assert command == ["echo", "hi", "--store", "x"]
    assert getattr(args, attr) == value


@pytest.mark.parametrize(("words", "name"), SHAPES)
def test_older_form_with_options_after_ref_and_dashes(words: tuple[str, ...], name: str) -> None:
    option, attr, value = OPTION[name]
    args, command = _split([*words, "R", *option, "--", "echo", "hi"], name)
    assert getattr(args, name) == "R" and command == ["echo", "hi"]
    assert getattr(args, attr) == value


@pytest.mark.parametrize(("words", "name"), SHAPES)
def test_options_after_ref_without_dashes_are_refused_not_dropped(
    words: tuple[str, ...], name: str
) -> None:
    with pytest.raises(UsageError, match="options go before") as refused:
        _split([*words, "R", *OPTION[name][0], "echo", "hi"], name)
    assert f"{OPTION[name][0][0]} after R:" in str(refused.value)  # not "after echo"


@pytest.mark.parametrize(("words", "name"), [s for s in SHAPES if s[0] != ("sandbox", "exec")])
def test_store_given_after_ref_says_where_it_goes(words: tuple[str, ...], name: str) -> None:
    with pytest.raises(UsageError, match=r"--store is required \(before REF"):
        _split([*words, "R", "echo", "hi", "--store", "S"], name)


def test_bad_option_after_ref_is_one_error() -> None:
    with pytest.raises(UsageError, match="invalid size") as caught:
        _split(["run", "R", "--store", "S", "--memory", "2X", "--", "true"], "ref")
    assert "\n" not in str(caught.value)


def test_sandbox_create_takes_options_on_both_sides_of_ref() -> None:
    args = _parse(["sandbox", "create", "--memory", "1G", "R", "--store", "S"])
    assert (args.ref, args.store, args.memory) == ("R", "S", 1 << 30)


@pytest.mark.parametrize("text", ["0", "-1", "x", ""])
def test_positive_refuses(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        positive(text)


def test_non_negative() -> None:
    assert non_negative("0") == 0.0
    with pytest.raises(argparse.ArgumentTypeError):
        non_negative("-0.5")


def test_env_pairs_as_docker_run_e(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HERE", "v=1")
    monkeypatch.delenv("NOT_HERE", raising=False)
    assert env_pair("A=b=c") == ("A", "b=c") and env_pair("A=") == ("A", "")
    assert env_pair("HERE") == ("HERE", "v=1") and env_pair("NOT_HERE") == ("NOT_HERE", None)
    for bad in ("", "=x"):
        with pytest.raises(argparse.ArgumentTypeError):
            env_pair(bad)
    pairs = [env_pair(t) for t in ("A=1", "HERE", "NOT_HERE", "B=2", "B=3")]
    assert env_dict(pairs) == {"A": "1", "HERE": "v=1", "B": "3"}


def test_a_missing_ref_is_named_alone(capsys: pytest.CaptureFixture[str]) -> None:
    """The command is optional (the entrypoint and cmd run): only REF is said missing."""
    assert cli.main(["run"]) == 2
    assert capsys.readouterr().err.endswith("error: the following arguments are required: REF\n")
