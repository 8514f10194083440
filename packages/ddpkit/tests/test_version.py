import ddpkit


def test_version() -> None:
    assert ddpkit.__version__ == "0.1.0"
