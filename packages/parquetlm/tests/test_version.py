import parquetlm


def test_version() -> None:
    assert parquetlm.__version__ == "0.1.0"
