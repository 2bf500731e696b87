"""``[train] checkpoint_io``: a value it does not know, and ``"mpio"`` where h5py has no
MPI (PyPI's h5py, this venv), are refused by name with how to build h5py with MPI. The
mpio path itself runs in the system-MPI leg (``tests/system_mpi``)."""

import pytest

from hpctrain.checkpoint import CheckpointError, writer
from hpctrain.config import Config, ConfigError, TrainConfig

needs_serial_h5py = pytest.mark.skipif(writer.parallel_hdf5(),
                                       reason="h5py has MPI here: tests/system_mpi runs mpio")


def validate(io: str) -> Config:
    return Config(train=TrainConfig(checkpoint_io=io)).validate(1)


def test_an_unknown_checkpoint_io_is_named():
    with pytest.raises(ConfigError, match=r"checkpoint_io \('hdf5'\) must be one of auto, "
                                          r"mpio, files"):
        validate("hdf5")


@needs_serial_h5py
def test_mpio_without_mpi_in_h5py_says_how_to_build_it():
    with pytest.raises(ConfigError) as err:
        validate("mpio")
    text = str(err.value)
    assert 'checkpoint_io ("mpio") needs h5py with MPI' in text
    assert "h5py.get_config().mpi is False" in text
    assert "HDF5_MPI=ON CC=mpicc" in text and "--no-binary=h5py" in text
    assert 'checkpoint_io = "files"' in text


@needs_serial_h5py
def test_the_writer_refuses_mpio_too_and_auto_means_files():
    with pytest.raises(CheckpointError, match="HDF5_MPI=ON"):
        writer.shared_file("mpio", 2)
    assert not writer.shared_file("auto", 4) and not writer.shared_file("files", 4)
    assert validate("auto").train.checkpoint_io == "auto"


def test_an_unknown_checkpoint_read_is_named():
    with pytest.raises(ConfigError, match=r"checkpoint_read \('once'\) must be one of each, "
                                          r"shared"):
        Config(train=TrainConfig(checkpoint_read="once")).validate(1)
    assert Config(train=TrainConfig(checkpoint_read="shared")).validate(1).train \
        .checkpoint_read == "shared"
