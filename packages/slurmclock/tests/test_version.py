import slurmclock


def test_version() -> None:
    assert slurmclock.__version__ == "0.1.0"
