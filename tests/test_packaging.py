"""One place pins the dependencies; environment.yml, pyproject.toml and the pins agree."""

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONDA_NAMES = {"pytorch": "torch"}  # conda-forge name -> PyPI name
NOT_PACKAGES = {"python", "pip"}


def pyproject_packages():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        names += extra
    return {re.split(r"[<>=!~\[; ]", n)[0].lower() for n in names}


def pins():
    lines = (ROOT / "constraints.txt").read_text().splitlines()
    pairs = [re.match(r"^([A-Za-z0-9_.-]+)==(\S+)$", ln.strip()) for ln in lines
             if ln.strip() and not ln.startswith("#")]
    assert all(pairs), "every line of constraints.txt is NAME==VERSION"
    return {m[1].lower(): m[2] for m in pairs}


def conda_packages():
    text = (ROOT / "environment.yml").read_text().split("dependencies:", 1)[1]
    found = re.findall(r"^  - ([A-Za-z0-9_.-]+)(?:=(\S+))?\s*$", text, re.M)
    return {CONDA_NAMES.get(n, n).lower(): v for n, v in found if n not in NOT_PACKAGES}


def test_every_dependency_is_pinned_once():
    assert pyproject_packages() == set(pins())


def test_environment_yml_mirrors_pyproject_and_pins():
    conda = conda_packages()
    assert set(conda) == pyproject_packages()
    for name, version in pins().items():
        assert conda[name] == version.removesuffix(".*"), name
    assert "-e ." in (ROOT / "environment.yml").read_text()


def test_torch_stays_on_the_local_cpu_build_series():
    assert pins()["torch"] == "2.13.*"


def test_ci_runs_the_readme_test_command():
    assert "make test" in (ROOT / "README.md").read_text()
    assert "make test" in (ROOT / ".ci" / "run").read_text()
