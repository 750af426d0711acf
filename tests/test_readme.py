"""The README's two commands stay true: CI runs the test command verbatim."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def readme_commands() -> list[str]:
    return re.findall(r"```bash\n(.+?)\n```", (ROOT / "README.md").read_text())


def test_readme_has_setup_and_test_commands_near_the_top():
    head = (ROOT / "README.md").read_text()[:2000]
    first, second = readme_commands()[:2]
    assert first in head and second in head
    assert "k3compile" in first and "specs/kimi-k3.yaml" in first
    assert "pytest" in second


def test_ci_runs_the_readme_test_command_verbatim():
    ci = (ROOT / ".ci" / "run").read_text()
    assert readme_commands()[1] in ci.splitlines()
