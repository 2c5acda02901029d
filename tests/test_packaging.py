"""The install paths agree: environment.yml lists the same packages as pyproject.toml; the supported torch and
Python are stated alike everywhere, and CI tests both ends of the torch range."""
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


def makefile_value(name):
    return re.search(rf"^{name}\s*[?:]?=\s*(.*)$", (ROOT / "Makefile").read_text(), re.M)[1].strip()


def test_the_supported_torch_range_is_stated_alike_and_tested_at_both_ends():
    oldest, newest = makefile_value("TORCH_OLDEST"), makefile_value("TORCH_NEWEST")
    floor = ".".join(oldest.split(".")[:2])
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert f"torch>={floor}" in project["dependencies"]
    assert re.search(rf"^\s+- torch>={re.escape(floor)}$", (ROOT / "environment.yml").read_text(), re.M)
    for name in ("README.md", "pyproject.toml", "environment.yml"):
        text = (ROOT / name).read_text()
        assert oldest in text and newest in text, f"{name} names both ends of the range, {oldest} and {newest}"
    assert "make compat-ends" in (ROOT / ".ci" / "run").read_text()
    assert "make compat" in (ROOT / "README.md").read_text()
    pinned = makefile_value("TORCH_SPEC").removeprefix("torch==")
    assert tuple(map(int, oldest.split("."))) <= tuple(map(int, pinned.split("."))) <= \
        tuple(map(int, newest.split("."))), "the pinned torch lies inside the supported range"


def test_only_the_tested_python_is_claimed():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["requires-python"] == ">=3.11"
    assert "python=3.11" in (ROOT / "environment.yml").read_text()
    assert 'python-version: "3.11"' in (ROOT / ".github" / "workflows" / "ci.yml").read_text()
    assert "3.10" not in (ROOT / "README.md").read_text()
