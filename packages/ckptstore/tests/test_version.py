import ckptstore


def test_version() -> None:
    assert ckptstore.__version__ == "0.1.0"


def test_public_api() -> None:
    for name in (
        "CheckpointStore",
        "SaveHandle",
        "SaveStats",
        "Manifest",
        "CheckpointInfo",
        "VerifyReport",
        "CheckpointError",
        "CorruptCheckpointError",
        "NoCheckpointError",
        "IncompatibleCheckpointError",
        "register_format",
        "get_format",
    ):
        assert name in ckptstore.__all__ and hasattr(ckptstore, name), name
