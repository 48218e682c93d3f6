"""The package as a user gets it: pyproject's pins equal requirements*.txt, and a wheel built
from this tree, installed into a fresh venv, starts the services from its console script and
runs the README's client snippet verbatim.

How the fresh venv stays cheap (the test must fit CI's budget on two cores, with no network for
torch's ~200 MB wheel): the venv is made `--without-pip`, and a .pth file in its site-packages
appends the site-packages of the venv running the tests, so the dependencies (torch,
transformers, grpcio...) are importable without being installed again. Then the wheel is
installed with the running venv's pip (`pip --python NEW_VENV install --no-index --no-deps
WHEEL`), and every requirement in the wheel's metadata is checked against the installed versions,
which checks the pins in the metadata in itself. The project's own code comes from the
wheel only: the running venv holds no copy of it (the tests import it from the checkout through
the working directory), every program runs from an empty temporary directory without
PYTHONPATH, and the test checks where `common` was imported from.
"""
from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess
import sys
import sysconfig
import tomllib

import pytest

from tests.support.procs import REPO, free_port, wait_serving

pytestmark = pytest.mark.timeout(240)

PACKAGES = ("common", "scheduler_svc", "worker_svc", "tools", "gateway")   # the top-level folders
# What the wheel is built from (a copy, so the build writes nothing into the checkout).
SOURCES = ("pyproject.toml", "README.md", *PACKAGES, "protos")
SNIPPET_MARKER = "<!-- client-snippet: tests/e2e/test_packaging.py runs the next block verbatim -->"


def _requirements(path: pathlib.Path) -> set[str]:
    """The pins of a requirements file, without those of the files it includes with -r."""
    lines = (line.split("#")[0].strip() for line in path.read_text().splitlines())
    return {line for line in lines if line and not line.startswith("-r")}


def test_pyproject_pins_equal_the_requirements_files():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert set(project["dependencies"]) == _requirements(REPO / "requirements.txt")
    assert set(project["optional-dependencies"]["gpu"]) == _requirements(REPO / "requirements-gpu.txt")
    assert set(project["optional-dependencies"]["dev"]) == _requirements(REPO / "requirements-dev.txt")
    for name in ("requirements-gpu.txt", "requirements-dev.txt"):
        assert "-r requirements.txt" in (REPO / name).read_text().splitlines()


def test_pyproject_lists_every_package_and_data_file():
    """A new subpackage or data file left out of pyproject.toml would be missing from the wheel."""
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    on_disk = {".".join(init.parent.relative_to(REPO).parts)
               for top in PACKAGES for init in (REPO / top).rglob("__init__.py")}
    assert set(setuptools["packages"]) - {"common.protos"} == on_disk
    patterns = {package: globs for package, globs in setuptools["package-data"].items()}
    data = [path for top in PACKAGES for path in (REPO / top).rglob("*")
            if path.is_file() and path.suffix not in (".py", ".pyc") and "__pycache__" not in path.parts]
    for path in data:
        package = ".".join(path.parent.relative_to(REPO).parts)
        owner = max((p for p in patterns if package == p or package.startswith(p + ".")), key=len)
        relative = path.relative_to(REPO.joinpath(*owner.split("."))).as_posix()
        assert any(pathlib.PurePosixPath(relative).match(glob) or (glob.startswith("**/") and
                   pathlib.PurePosixPath(relative).match(glob[3:])) for glob in patterns[owner]), path


def test_readme_names_every_subcommand_with_its_module():
    """The README's command table: one row per `qwen3-serve` subcommand, naming the module it runs."""
    from tools.commands import PROGRAMS, load

    readme = (REPO / "README.md").read_text()
    for name in PROGRAMS:
        row = next((line for line in readme.splitlines() if line.startswith(f"| `{name}` |")), None)
        assert row is not None, f"README.md has no row for `qwen3-serve {name}`"
        if name != "protos":
            assert f"python -m {load(name).__name__.removesuffix('.__main__')}`" in row, row


def readme_client_snippet() -> str:
    text = (REPO / "README.md").read_text()
    assert SNIPPET_MARKER in text, f"README.md lost the marker {SNIPPET_MARKER!r}"
    match = re.search(r"```python\n(.*?)```", text[text.index(SNIPPET_MARKER):], re.S)
    assert match, "no ```python block after the client-snippet marker"
    return match.group(1)


def _build_wheel(tmp: pathlib.Path) -> pathlib.Path:
    src = tmp / "src"
    for name in SOURCES:
        source = REPO / name
        if source.is_dir():
            shutil.copytree(source, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            src.mkdir(exist_ok=True)
            shutil.copy(source, src / name)
    wheels = tmp / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "--disable-pip-version-check", "-w", str(wheels), str(src)], check=True, timeout=120)
    [wheel] = wheels.glob("qwen3_serve-*.whl")
    return wheel


def _fresh_venv(tmp: pathlib.Path, wheel: pathlib.Path) -> pathlib.Path:
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    python = venv / "bin" / "python"
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    (pathlib.Path(site) / "_dependencies_from_the_test_venv.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    # --force-reinstall: a copy of the project installed in the test venv (`pip install -e .`) is
    # visible through the .pth file and would otherwise count as "already satisfied".
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--no-index",
                    "--no-deps", "--force-reinstall", "--disable-pip-version-check", str(wheel)],
                   check=True, timeout=180)
    unmet = subprocess.run([python, "-c", _UNMET_REQUIREMENTS], check=True, capture_output=True, text=True).stdout
    assert not unmet.strip(), f"the wheel's pins are not what is installed:\n{unmet}"
    return venv


# Run in the new venv: every requirement of the installed wheel (extras aside) that the
# environment does not satisfy, one per line.
_UNMET_REQUIREMENTS = """
from importlib.metadata import PackageNotFoundError, distribution, version
from packaging.requirements import Requirement
for requirement in map(Requirement, distribution("qwen3-serve").requires or []):
    if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
        continue
    try:
        installed = version(requirement.name)
    except PackageNotFoundError:
        installed = None
    if installed is None or not requirement.specifier.contains(installed, prereleases=True):
        print(requirement, "installed:", installed)
"""


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """A fresh venv with the wheel installed, and an empty directory to run from."""
    tmp = tmp_path_factory.mktemp("packaging")
    venv = _fresh_venv(tmp, _build_wheel(tmp))
    run_dir = tmp / "cwd"
    run_dir.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return venv, run_dir, env


def test_the_wheel_holds_the_stubs_the_protos_and_the_command(installed):
    venv, run_dir, env = installed
    where = subprocess.run(
        ["python", "-c", "import common.client, common.pb.llm.v1.generation_pb2 as pb; "
                         "print(common.client.__file__); print(pb.__file__)"],
        cwd=run_dir, env=env, check=True, capture_output=True, text=True).stdout.split()
    assert all(path.startswith(str(venv)) for path in where), where
    protos = subprocess.run(["qwen3-serve", "protos", "--out", "exported"], cwd=run_dir, env=env, check=True,
                            capture_output=True, text=True).stdout.split()
    assert sorted(protos) == sorted(f"exported/{p.relative_to(REPO / 'protos').as_posix()}"
                                    for p in (REPO / "protos").rglob("*.proto"))
    assert (run_dir / "exported/llm/v1/generation.proto").read_text() == \
        (REPO / "protos/llm/v1/generation.proto").read_text()
    listing = subprocess.run(["qwen3-serve", "--help"], cwd=run_dir, env=env, check=True, capture_output=True,
                             text=True).stdout
    assert all(name in listing for name in ("scheduler", "worker", "gateway", "generate", "loadtest", "write-tiny-model"))


def test_services_from_the_console_script_answer_the_readme_snippet(installed, tmp_path):
    venv, run_dir, env = installed
    subprocess.run(["qwen3-serve", "write-tiny-model", "--out", str(tmp_path / "model")], cwd=run_dir, env=env,
                   check=True, capture_output=True, timeout=120)
    worker_port, scheduler_port = free_port(), free_port()
    logs = {name: tmp_path / f"{name}.log" for name in ("worker", "scheduler")}
    commands = {
        "worker": ["qwen3-serve", "worker", "--model", str(tmp_path / "model"), "--port", str(worker_port),
                   "--device", "cpu"],
        "scheduler": ["qwen3-serve", "scheduler", "--model", str(tmp_path / "model"), "--port", str(scheduler_port),
                      "--workers", f"127.0.0.1:{worker_port}"],
    }
    procs: dict[str, subprocess.Popen] = {}
    try:
        for name in ("worker", "scheduler"):
            procs[name] = subprocess.Popen(commands[name], cwd=run_dir, env=env, stdout=logs[name].open("wb"),
                                           stderr=subprocess.STDOUT)
        wait_serving(f"127.0.0.1:{worker_port}", procs["worker"], logs["worker"])
        wait_serving(f"127.0.0.1:{scheduler_port}", procs["scheduler"], logs["scheduler"])
        snippet = run_dir / "snippet.py"
        snippet.write_text(readme_client_snippet())
        result = subprocess.run(["python", snippet.name], cwd=run_dir, capture_output=True, text=True, timeout=120,
                                env=dict(env, QWEN3_SERVE_TARGET=f"127.0.0.1:{scheduler_port}"))
        assert result.returncode == 0, result.stderr
        assert re.search(r"^(length|stop) Usage\(prompt_tokens=\d+, completion_tokens=\d+", result.stdout, re.M), \
            result.stdout
        generated = subprocess.run(["qwen3-serve", "generate", "--target", f"127.0.0.1:{scheduler_port}", "Hello",
                                    "--max-tokens", "4"], cwd=run_dir, env=env, capture_output=True, text=True,
                                   timeout=60)
        assert generated.returncode == 0 and re.search(r"\[(length|stop): ", generated.stdout), generated
    finally:
        for proc in procs.values():
            proc.terminate()
        for proc in procs.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    for name in procs:
        assert "listens on" not in logs[name].read_text(), "a loopback server warned about exposure"
