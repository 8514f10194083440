import ckptstore


def test_version() -> None:
    assert ckptstore.__version__ == "0.1.0"
