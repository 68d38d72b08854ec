"""Repository contracts: CI runs README's test command verbatim."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    return re.findall(r"```bash\n(.*?)\n```", text, flags=re.S)


def test_ci_runs_readme_test_command():
    commands = _readme_commands()
    assert len(commands) >= 2, "README must start with the main-job and the test command"
    test_command = commands[1].strip()
    assert "pytest" in test_command
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert test_command in ci, f".ci/run does not run README's test command:\n{test_command}"


def test_main_job_uses_example_prompts():
    main = _readme_commands()[0]
    assert "jaxserve.launch.generate" in main
    for path in re.findall(r"--input (\S+)", main):
        assert (ROOT / path).exists(), path
