"""Property tests of the command line: every bad option value is one ``error:`` line.

Every numeric option of ``silodp account`` and ``silodp run`` is given values a user can type
by mistake — zero, negative, huge, NaN, ±inf, text, a fraction for a count — and ``run``,
``describe`` and ``ledger show|verify`` are given paths that do not exist, are files where a
directory is needed (or the reverse), cannot be written, or hold garbage. Each must end with
exit code 2 and an ``error:`` line that names the option (or the value) and says what was
expected, without a traceback, and without writing anything to ``--out``. All in process
(typer's CliRunner); nothing trains.
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from silodp.cli import MAX_TIMEOUT, app
from silodp.cli.account import MAX_COUNT, MAX_NOISE_MULTIPLIER

SETTINGS = settings(
    max_examples=25,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)

runner = CliRunner()

ROOT = Path(__file__).resolve().parents[2]
SMOKE = ROOT / "configs" / "smoke.toml"

SILOS = 3
ACCOUNT = ["account", "--algorithm", "local_item_dp", "--silos", str(SILOS), "--group-size", "2"]


def _parses_as_float(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


#: text that is no number at all
WORDS = st.from_regex(r"\A[a-z_ ]{0,8}\Z").filter(lambda s: not _parses_as_float(s))
NOT_FINITE = st.sampled_from(["nan", "inf", "-inf", "NaN", "Infinity"])
NEGATIVE = st.floats(max_value=-1e-12, allow_nan=False, allow_infinity=False).map(repr)


def bad_numbers(*, zero_ok: bool, above: float | None, integer: bool) -> st.SearchStrategy[str]:
    """Values an option must refuse: NaN/inf, negative, zero (unless valid), anything above
    ``above`` (huge), words, and for a count, fractions and exponents."""
    options = [NOT_FINITE, NEGATIVE, WORDS]
    if integer:
        options.append(st.integers(max_value=-1).map(str))
        options.append(st.floats(0.01, 1e6).filter(lambda v: v != int(v)).map(repr))
        options.append(st.sampled_from(["1e3", "2.0", "0x10"]))
    if not zero_ok:
        options.append(st.sampled_from(["0", "0.0", "-0"] if not integer else ["0", "-0"]))
    if above is not None:
        if integer:
            options.append(st.integers(min_value=int(above) + 1, max_value=10**40).map(str))
        else:
            options.append(st.floats(min_value=above, max_value=1e308, exclude_min=True).map(repr))
    return st.one_of(*options)


def _error_line(result: Any) -> str:
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(
        result.exception
    )
    assert "Traceback" not in result.output
    assert result.exit_code == 2, result.output[-1000:]
    lines = [ln for ln in result.output.splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1, result.output[-1000:]
    return lines[0]


def _names(line: str, option: str, value: str) -> None:
    """The error line names the option (as typed, or as the library's parameter) or the value,
    and says what was expected."""
    bare = option.lstrip("-").replace("-", "_")
    assert option in line or bare in line or (value and value in line), (line, option, value)
    assert "Expected" in line or "Invalid value" in line, line


#: (option, 0 is valid, values above this are refused, a count, the command before it)
ACCOUNT_OPTIONS: list[tuple[str, bool, float | None, bool, list[str]]] = [
    ("--delta", False, 1.0 - 1e-16, False, [*ACCOUNT, "--noise-multiplier", "1"]),
    ("--noise-multiplier", False, MAX_NOISE_MULTIPLIER, False, ACCOUNT),
    ("--target-epsilon", False, 100.0, False, ACCOUNT),
    ("--sample-rate", True, 1.0, False, [*ACCOUNT, "--noise-multiplier", "1"]),
    ("--steps", False, MAX_COUNT, True, [*ACCOUNT, "--noise-multiplier", "1"]),
    ("--rounds", False, 10**6, True, [*ACCOUNT, "--noise-multiplier", "1"]),
    (
        "--silos",
        False,
        MAX_COUNT,
        True,
        ["account", "--algorithm", "user_ldp", "--noise-multiplier", "9"],
    ),
    (
        "--clients",
        False,
        MAX_COUNT,
        True,
        ["account", "--algorithm", "prifedsync", "--noise-multiplier", "1"],
    ),
    ("--silos-per-round", False, SILOS, True, [*ACCOUNT, "--noise-multiplier", "1"]),
    ("--span", False, SILOS, True, [*ACCOUNT, "--noise-multiplier", "1"]),
    ("--group-size", False, MAX_COUNT, True, [*ACCOUNT, "--noise-multiplier", "1"]),
    (
        "--client-rate",
        False,
        1.0,
        False,
        ["account", "--algorithm", "prifedsync", "--noise-multiplier", "1", "--clients", "4"],
    ),
]


@pytest.mark.parametrize(
    ("option", "zero_ok", "above", "integer", "base"),
    ACCOUNT_OPTIONS,
    ids=[o[0] for o in ACCOUNT_OPTIONS],
)
def test_account_refuses_every_bad_number(
    option: str, zero_ok: bool, above: float | None, integer: bool, base: list[str]
) -> None:
    @SETTINGS
    @given(value=bad_numbers(zero_ok=zero_ok, above=above, integer=integer))
    def check(value: str) -> None:
        line = _error_line(runner.invoke(app, [*base, f"{option}={value}"]))
        _names(line, option, value)

    check()


def test_the_bad_numbers_are_refused_and_good_ones_accepted_by_account() -> None:
    """The strategy's boundaries are right: the edge values just inside are accepted."""
    good = [
        ["--delta=0.5"],
        ["--noise-multiplier", str(MAX_NOISE_MULTIPLIER)],
        ["--sample-rate=0"],
        ["--span", str(SILOS)],
        ["--silos-per-round", "1"],
    ]
    for extra in good:
        args = [*ACCOUNT, *extra]
        if "--noise-multiplier" not in extra:
            args += ["--noise-multiplier", "1"]
        result = runner.invoke(app, [*args, "--json"])
        assert result.exit_code == 0, (extra, result.output)


@pytest.fixture(scope="module")
def sandbox() -> Any:
    with tempfile.TemporaryDirectory(prefix="silodp-fuzz-cli-") as root:
        yield Path(root)


def _fresh(root: Path) -> Path:
    return Path(tempfile.mkdtemp(dir=root))


def _run_args(where: Path, bad: str) -> tuple[list[str], str]:
    """``run`` arguments with one bad path, and the option it is given to."""
    a_file = where / "a-file"
    a_file.write_text("not a directory")
    out = ["--out", str(where / "out")]
    cases: dict[str, tuple[list[str], str]] = {
        "out under a file": (
            [str(SMOKE), "--out", str(a_file / "results")],
            "--out",
        ),
        "out is a file": ([str(SMOKE), "--out", str(a_file)], "--out"),
        "out where no file can be made": (
            [str(SMOKE), "--out", "/proc/silodp-fuzz/out"],
            "--out",
        ),
        "config missing": ([str(where / "missing.toml"), *out], "CONFIG"),
        "config is a directory": ([str(where), *out], "CONFIG"),
        "resume missing": (["--resume", str(where / "missing")], "--resume"),
        "resume is a file": (["--resume", str(a_file)], "--resume"),
        "ledger is a directory": ([str(SMOKE), *out, "--ledger", str(where)], "--ledger"),
        "ledger under a file": (
            [str(SMOKE), *out, "--ledger", str(a_file / "ledger.sqlite")],
            "--ledger",
        ),
        "engine unknown": ([str(SMOKE), *out, "--engine", "nope"], "--engine"),
        "on-failure unknown": ([str(SMOKE), *out, "--on-failure", "retry"], "--on-failure"),
    }
    return cases[bad]


RUN_PATH_CASES = [
    "out under a file",
    "out is a file",
    "out where no file can be made",
    "config missing",
    "config is a directory",
    "resume missing",
    "resume is a file",
    "ledger is a directory",
    "ledger under a file",
    "engine unknown",
    "on-failure unknown",
]


def _forbid_slow(monkeypatch: pytest.MonkeyPatch) -> None:
    def slow(*args: object, **kwargs: object) -> None:
        raise AssertionError("a config was loaded: the bad option was not found first")

    monkeypatch.setattr("silodp.config.load_config", slow)
    monkeypatch.setattr("silodp.experiment.run.load_config", slow)


def _nothing_written(where: Path) -> None:
    assert not (where / "out").exists()
    assert sorted(p.name for p in where.iterdir()) == ["a-file"]
    assert (where / "a-file").read_text() == "not a directory"


@pytest.mark.parametrize("bad", RUN_PATH_CASES)
def test_run_refuses_bad_paths_before_anything_slow(
    sandbox: Path, monkeypatch: pytest.MonkeyPatch, bad: str
) -> None:
    if bad == "out where no file can be made" and not Path("/proc/self").is_dir():
        pytest.skip("needs Linux /proc")
    _forbid_slow(monkeypatch)
    where = _fresh(sandbox)
    args, option = _run_args(where, bad)
    line = _error_line(runner.invoke(app, ["run", *args]))
    _names(line, option, "")
    _nothing_written(where)


@SETTINGS
@given(
    value=bad_numbers(zero_ok=False, above=MAX_TIMEOUT, integer=False),
    bad_path=st.sampled_from([None, *RUN_PATH_CASES[:3]]),
)
def test_run_refuses_every_bad_timeout(
    sandbox: Path, monkeypatch: pytest.MonkeyPatch, value: str, bad_path: str | None
) -> None:
    _forbid_slow(monkeypatch)
    where = _fresh(sandbox)
    (where / "a-file").write_text("not a directory")
    args = [str(SMOKE), "--out", str(where / "out")]
    if bad_path is not None:  # two bad options: either is reported, nothing is written
        args = _run_args(where, bad_path)[0]
    line = _error_line(runner.invoke(app, ["run", *args, f"--timeout={value}"]))
    if bad_path is None:
        _names(line, "--timeout", value)
    _nothing_written(where)


def _garbage_file(where: Path, content: bytes) -> Path:
    path = where / "file"
    path.write_bytes(content)
    return path


PATH_KINDS: dict[str, Callable[[Path, bytes], Path]] = {
    "missing": lambda where, _: where / "missing",
    "directory": lambda where, _: where,
    "under a file": lambda where, content: _garbage_file(where, content) / "inner",
    "garbage": _garbage_file,
    "sqlite header and garbage": lambda where, content: _garbage_file(
        where, b"SQLite format 3\x00" + content
    ),
}


@SETTINGS
@given(
    command=st.sampled_from([["describe"], ["ledger", "show"], ["ledger", "verify"]]),
    kind=st.sampled_from(sorted(PATH_KINDS)),
    content=st.binary(max_size=300),
)
def test_path_commands_refuse_bad_files(
    sandbox: Path, command: list[str], kind: str, content: bytes
) -> None:
    where = _fresh(sandbox)
    path = PATH_KINDS[kind](where, content)
    before = {p: p.read_bytes() for p in where.rglob("*") if p.is_file()}
    result = runner.invoke(app, [*command, str(path)])
    if command == ["describe"] and kind in ("garbage", "sqlite header and garbage"):
        # garbage may still be a valid (empty) TOML config: describe then shows the demo data
        if result.exit_code == 0:
            return
    line = _error_line(result)
    shown = str(path if kind != "under a file" else path)
    assert shown in line or str(path.parent) in line or "config" in line.lower(), line
    assert "Expected" in line or "not" in line, line
    after = {p: p.read_bytes() for p in where.rglob("*") if p.is_file()}
    assert after == before  # nothing created or changed


def test_bad_numbers_strategy_covers_the_kinds() -> None:
    """The strategy draws every kind of bad value (so a property above is not vacuous)."""
    seen: set[str] = set()

    @settings(max_examples=200, deadline=None, derandomize=True, database=None)
    @given(value=bad_numbers(zero_ok=False, above=10, integer=True))
    def collect(value: str) -> None:
        try:
            number = float(value)
        except ValueError:
            seen.add("text")
            return
        if math.isnan(number) or math.isinf(number):
            seen.add("not finite")
        elif number < 0:
            seen.add("negative")
        elif number == 0:
            seen.add("zero")
        elif number > 10:
            seen.add("huge")
        else:
            seen.add("fraction")

    collect()
    assert seen == {"text", "not finite", "negative", "zero", "huge", "fraction"}
