"""The README's commands stay true: CI runs the test command verbatim, and the "Using it" block runs top to bottom."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

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


STEPS = re.compile(r"--steps \d+")


def using_it_commands() -> list[str]:
    """The shell commands of the README's "Using it" block, continuation lines joined, comments dropped."""
    text = (ROOT / "README.md").read_text()
    block = re.search(r"## Using it\n\n```bash\n(.+?)\n```", text, re.S).group(1)
    lines = re.sub(r"\\\n\s*", "", block).splitlines()
    return [re.sub(r"\s+#[^\"']*$", "", line).strip() for line in lines if line.strip()]


def test_using_it_block_parses_to_commands():
    commands = using_it_commands()
    assert commands[0].startswith("k3compile build specs/k3-tiny.yaml") and len(commands) >= 20
    assert all(c.split()[0] in ("k3compile", "python") for c in commands)


@pytest.mark.slow
def test_using_it_block_runs_top_to_bottom(tmp_path):
    """Every command of "Using it", in order, in a folder holding a copy of specs/ (a fresh clone's view), with
    --steps N made 2 and one thread per process (the test's CPU budget): each must exit 0."""
    shutil.copytree(ROOT / "specs", tmp_path / "specs")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    env.pop("PYTHONPATH", None)
    env["OMP_NUM_THREADS"] = "1"
    for command in using_it_commands():
        command = STEPS.sub("--steps 2", command)
        done = subprocess.run(command, shell=True, cwd=tmp_path, env=env, capture_output=True, text=True)
        assert done.returncode == 0, f"{command}\n{done.stderr[-3000:]}"
