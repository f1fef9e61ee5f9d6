"""The node's on/off environment variables (weenvfs/switches.py): one set of words for every
switch, and a value that is neither on nor off is a one-line usage error, never "on"."""

from __future__ import annotations

import pytest

from weenvfs.errors import UsageError
from weenvfs.switches import problem, switched_off

NAME = "WEENV_TEST_SWITCH"


@pytest.mark.parametrize(("value", "off"), [
    (None, False), ("", False), ("on", False), ("1", False), ("YES", False), (" true ", False),
    ("off", True), ("0", True), ("No", True), (" FALSE\n", True),
])
def test_the_words_for_on_and_off(monkeypatch: pytest.MonkeyPatch, value: str | None,
                                  off: bool) -> None:
    if value is None:
        monkeypatch.delenv(NAME, raising=False)
    else:
        monkeypatch.setenv(NAME, value)
    assert switched_off(NAME) is off
    assert problem(NAME) is None


@pytest.mark.parametrize("value", ["of", "disable", "2", "off please"])
def test_anything_else_is_a_usage_error_naming_the_variable(monkeypatch: pytest.MonkeyPatch,
                                                            value: str) -> None:
    monkeypatch.setenv(NAME, value)
    with pytest.raises(UsageError) as caught:
        switched_off(NAME)
    assert str(caught.value) == f"${NAME} is {value!r}: set it to on or off (or unset it)"
    assert problem(NAME) == str(caught.value)
