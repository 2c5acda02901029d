"""The install paths agree: environment.yml lists the same packages as pyproject.toml."""
import pathlib
import re
import tomllib

ROOT = pathlib.Path(__file__).resolve().parent.parent


def names(requirements):
    return {re.split(r"[<>=!~\[ ;]", r.strip(), maxsplit=1)[0].lower() for r in requirements if r.strip()}


def test_environment_yml_matches_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = names(project["dependencies"]) | names(sum(project["optional-dependencies"].values(), []))
    pip_section = re.search(r"- pip:\n((?:\s+- .*\n?)+)", (ROOT / "environment.yml").read_text()).group(1)
    listed = names(line.strip()[2:] for line in pip_section.splitlines())
    assert listed == declared, f"only in environment.yml: {listed - declared}; only in pyproject: {declared - listed}"


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    assert "make test" in readme and "make run" in readme
    assert "make test" in (ROOT / ".ci" / "run").read_text()
    workflow = (ROOT / ".github" / "workflows" / "ci.yml").read_text()
    assert re.search(r"^\s*- run: \.ci/run\b", workflow, re.M), "the workflow runs .ci/run (browser test required)"
