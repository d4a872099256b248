"""The README stays honest: within its word budget, opening with the two commands a newcomer
needs (the test one exactly what CI runs), and documenting every key of the job file.

The keys come from the code, not from a list here: the sections are the fields of
:class:`fusion.config.JobSpec`, each a dataclass whose fields are its TOML keys; the
built-in models' keyword keys are their config dataclasses' fields, and the built-in data
sets' keys their constructors' parameters.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import io
import re
import typing
from pathlib import Path

import pytest

from fusion.config import JobSpec
from fusion.data import Cifar10Binary, GeneratedShapes, PySourceText
from fusion.job_sections import Section
from fusion.models.gpt2 import GPT2Config
from fusion.models.resnet import ResNetConfig

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
CI_RUN = ROOT / ".ci" / "run"

MAX_WORDS = 2500
JOB_REFERENCE = "## The job file"

#: Keys of [data] that a built-in data set's constructor takes from elsewhere, not [data].
DATA_KEYS_FROM_ELSEWHERE = {"seed"}  # GeneratedShapes gets train.seed


def _readme() -> str:
    return README.read_text(encoding="utf-8")


def _section(text: str, heading: str) -> str:
    """The text under ``heading`` up to the next heading of the same or a higher level."""
    level = len(heading) - len(heading.lstrip("#"))
    start = text.find("\n" + heading + "\n")
    assert start >= 0, f"README has no heading {heading!r}"
    body = text[start + len(heading) + 2 :]
    nxt = re.search(rf"^#{{1,{level}}} ", body, flags=re.MULTILINE)
    return body[: nxt.start()] if nxt else body


def _job_sections() -> dict[str, type[Section]]:
    """Every section of a job file, by its TOML table name, from JobSpec's fields."""
    hints = typing.get_type_hints(JobSpec)
    sections = {}
    for f in dataclasses.fields(JobSpec):
        cls = hints[f.name]
        if isinstance(cls, type) and issubclass(cls, Section):
            sections[cls.section] = cls
    return sections


def _section_keys(cls: type[Section]) -> list[str]:
    return [f.name for f in dataclasses.fields(cls) if f.name != "kwargs"]


def _ci_commands() -> tuple[list[str], str]:
    """The pip installs .ci/run makes before the tests, and its test command."""
    lines = [line.strip() for line in CI_RUN.read_text(encoding="utf-8").splitlines()]
    commands = [line for line in lines if line and not line.startswith("#")]
    pytest_line = next(line for line in commands if re.match(r"python -m pytest\b", line))
    installs = [line for line in commands[: commands.index(pytest_line)] if re.search(r"\bpip install\b", line)]
    return installs, pytest_line


def _opening_commands() -> list[str]:
    """The commands of the README's first code block, which must come before any section."""
    text = _readme()
    match = re.search(r"^```[a-z]*\n(.*?)^```", text, flags=re.MULTILINE | re.DOTALL)
    assert match is not None, "README has no code block"
    first_heading = re.search(r"^## ", text, flags=re.MULTILINE)
    assert first_heading is None or match.start() < first_heading.start(), (
        "the README's first code block (the two commands) must come before its first section"
    )
    lines = [line.strip() for line in match.group(1).splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def test_readme_is_within_its_word_budget() -> None:
    words = len(_readme().split())
    assert words <= MAX_WORDS, f"README.md has {words} words; the budget is {MAX_WORDS} (move detail to docs/)"


def test_readme_starts_with_the_demo_and_the_test_command() -> None:
    commands = _opening_commands()
    assert len(commands) == 2, f"the README must open with two commands (run the demo, run the tests), got {commands}"
    demo, tests = commands
    installs, pytest_line = _ci_commands()
    assert demo.split(" && ")[0] == installs[0], "the demo command must install the torch CI pins first"
    assert demo.endswith("fusion demo"), f"the first command must end by running `fusion demo`, got {demo!r}"
    assert "pip install -e ." in demo
    expected = " && ".join([*installs, pytest_line])
    assert tests == expected, f"the README's test command must be what .ci/run runs: {expected!r}, got {tests!r}"


@pytest.mark.parametrize("section", sorted(_job_sections()))
def test_job_reference_documents_every_key_of_each_section(section: str) -> None:
    reference = _section(_readme(), JOB_REFERENCE)
    body = _section(reference, f"### `[{section}]`")
    missing = [key for key in _section_keys(_job_sections()[section]) if f"`{key}`" not in body]
    assert not missing, f"README's job reference, [{section}], does not document {missing}"


def test_job_reference_documents_the_top_level_name() -> None:
    top = [f.name for f in dataclasses.fields(JobSpec) if f.name not in _job_sections()]
    reference = _section(_readme(), JOB_REFERENCE)
    assert all(f"`{key}`" in reference for key in top), f"the job reference must document top-level keys {top}"


@pytest.mark.parametrize(
    ("section", "keys"),
    [
        ("model", [f.name for f in dataclasses.fields(GPT2Config)]),
        ("model", [f.name for f in dataclasses.fields(ResNetConfig)]),
        *(
            ("data", [p for p in inspect.signature(cls).parameters if p not in DATA_KEYS_FROM_ELSEWHERE])
            for cls in (PySourceText, GeneratedShapes, Cifar10Binary)
        ),
    ],
)
def test_job_reference_documents_the_builtin_keyword_keys(section: str, keys: list[str]) -> None:
    body = _section(_section(_readme(), JOB_REFERENCE), f"### `[{section}]`")
    missing = [key for key in keys if f"`{key}`" not in body]
    assert not missing, f"README's job reference, [{section}], does not document built-in keys {missing}"


def test_job_reference_is_found_with_every_section() -> None:
    reference = _section(_readme(), JOB_REFERENCE)
    headings = re.findall(r"^### `\[(\w+)\]`$", reference, flags=re.MULTILINE)
    assert sorted(headings) == sorted(_job_sections()), "one `### [section]` heading per job section, no others"


def _help(build_parser: typing.Callable[[], typing.Any], args: list[str]) -> str:
    """The ``--help`` text of a command (or sub-command), as its parser prints it."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args([*args, "--help"])
    assert exit_info.value.code == 0, f"README runs a command that does not exist: {args}: {err.getvalue()}"
    return out.getvalue()


def _command_lines() -> list[list[str]]:
    """Every command line of the README's shell code blocks, continuations joined, as words."""
    blocks = re.findall(r"^```bash\n(.*?)^```", _readme(), flags=re.MULTILINE | re.DOTALL)
    lines = [line for block in blocks for line in block.replace("\\\n", " ").splitlines()]
    return [line.split("#")[0].replace("&&", " && ").split() for line in lines if line.strip()]


def test_readme_commands_and_flags_exist() -> None:
    from fusion.cli import coordinator, main, worker

    parsers = {"fusion": main.build_parser, "fusion-worker": worker.build_parser}
    parsers["fusion-coordinator"] = coordinator.build_parser
    checked = 0
    for words in _command_lines():
        for i, word in enumerate(words):
            if word not in parsers or (i > 0 and words[i - 1] != "&&"):
                continue
            rest = words[i + 1 :]
            rest = rest[: rest.index("&&")] if "&&" in rest else rest
            sub = [rest[0]] if word == "fusion" else []
            text = _help(parsers[word], sub)
            flags = [re.sub(r"[\[\]|]", "", w).split("=")[0] for w in rest if w.lstrip("[").startswith("--")]
            unknown = [f for f in flags if f not in text]
            assert not unknown, f"README runs `{word} {' '.join(sub)}` with flags it does not take: {unknown}"
            checked += 1
    assert checked >= 3, "the README's commands were not found"
