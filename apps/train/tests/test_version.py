import pyrecover_train


def test_version() -> None:
    assert pyrecover_train.__version__ == "0.1.0"
