"""Test, lint, type and benchmark sessions for the PyRecover monorepo.

Each package is tested in a virtualenv that holds only that package (and the test tools), so a
dependency the package forgot to declare fails its own session. torch is pinned through
constraints.txt so CI takes the local CPU wheel instead of the newest CUDA build.

    nox -l            # list sessions
    nox               # what CI runs (every session below except bench)
    nox -s ckptstore  # one package
"""

from __future__ import annotations

import os
from pathlib import Path

import nox

ROOT = Path(__file__).parent
CONSTRAINTS = ("-c", str(ROOT / "constraints.txt"))
TEST_TOOLS = ("pytest>=8", "pytest-timeout>=2.2", "hypothesis>=6.90")

PACKAGES = {
    # session name: (install spec, extra test-only requirements)
    "slurmclock": ("./packages/slurmclock", ()),
    # [wandb]: the real offline W&B test runs; numpy: the tests of ddpkit's numpy paths (that
    # ddpkit works without numpy is tested in a subprocess that blocks the import).
    "ddpkit": ("./packages/ddpkit[wandb]", ("numpy",)),
    "ckptstore": ("./packages/ckptstore[s3]", ("moto[server]>=5",)),
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
    *PACKAGES,
    "train",
    "e2e",
]


def _install(session: nox.Session, *specs: str) -> None:
    session.install(*CONSTRAINTS, *specs)


def _pytest(session: nox.Session, *args: str) -> None:
    # Exit code 5 is pytest's "no tests collected": not a failure for a package that has none yet.
    session.run("python", "-m", "pytest", *args, *session.posargs, success_codes=[0, 5])


@nox.session
def repo(session: nox.Session) -> None:
    """House rules: layout of every package, no package importing a sibling."""
    _install(session, "pytest>=8")
    _pytest(session, "tests")


@nox.session
def lint(session: nox.Session) -> None:
    _install(session, "ruff>=0.6")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def types(session: nox.Session) -> None:
    _install(session, "mypy>=1.10", *ALL_LOCAL, "./apps/train[plot]", *TEST_TOOLS)
    session.run(
        "mypy",
        "packages/slurmclock/src",
        "packages/ddpkit/src",
        "packages/ckptstore/src",
        "packages/parquetlm/src",
        "apps/train/src",
    )


def _package_session(name: str, spec: str, extra: tuple[str, ...]) -> None:
    @nox.session(name=name)
    def _run(session: nox.Session) -> None:
        _install(session, spec, *TEST_TOOLS, *extra)
        _pytest(session, f"packages/{name}/tests")

    _run.__doc__ = f"Tests of {name}, installed alone."


for _name, (_spec, _extra) in PACKAGES.items():
    _package_session(_name, _spec, _extra)


@nox.session
def train(session: nox.Session) -> None:
    """Tests of pyrecover-train (the app), with the four packages it composes."""
    _install(session, *ALL_LOCAL, "./apps/train[s3,plot]", *TEST_TOOLS, "moto[server]>=5")
    _pytest(session, "apps/train/tests")


@nox.session
def e2e(session: nox.Session) -> None:
    """Real SLURM + real S3 (moto_server) + fault injection against pyrecover-train."""
    _install(session, *ALL_LOCAL, "./apps/train[s3,plot]", *TEST_TOOLS, "moto[server]>=5")
    _pytest(session, "e2e", "-p", "no:cacheprovider", "-s")


@nox.session
def bench(session: nox.Session) -> None:
    """Side-by-side benchmarks (not part of CI's default set). Results go to bench/results/."""
    _install(
        session,
        *ALL_LOCAL,
        "./apps/train[s3,plot]",
        "moto[server]>=5",
        "safetensors>=0.4",
        "matplotlib>=3.7",
    )
    suites = session.posargs or ["all"]
    env = {
        "PYTHONUNBUFFERED": "1",
        **{k: v for k, v in os.environ.items() if k.startswith("BENCH_")},
    }
    session.run("python", "bench/run.py", *suites, env=env)
