"""Install hpctrain: `pip install -e .[test,mpich,plot,fused]`, as the Makefile's `install`
does (`plot`: matplotlib for `hpctrain plot`; `fused`: numba's element-wise kernels)."""

from setuptools import find_packages, setup

setup(
    name="hpctrain",
    version="0.1.0",
    description="MPI-parallel training of NumPy models: data, tensor and pipeline "
    "parallelism, HDF5 datasets and checkpoints, SLURM job templates.",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.11",
    packages=find_packages(include=["hpctrain", "hpctrain.*", "data_prep", "data_prep.*"]),
    install_requires=[
        "numpy>=1.26",
        "mpi4py>=3.1",
        "h5py>=3.8",
        "click>=8.1",
        # Sets the BLAS thread count of an already-loaded NumPy; environment
        # variables only work before the first import, which a library cannot control.
        "threadpoolctl>=3.1",
        # NumPy's bfloat16 dtype ([train] precision = "bf16", [parallel] grad_comm_dtype)
        "ml_dtypes>=0.4",
    ],
    extras_require={
        "test": ["pytest>=7", "pytest-mpi>=0.6", "pytest-timeout>=2.1", "ruff>=0.5"],
        # Laptops: the MPICH wheel puts `mpiexec` into the venv. Clusters use their
        # system MPI instead (build mpi4py against it and leave this extra out).
        "mpich": ["mpich"],
        # PNG loss curves and schedule pictures (hpctrain plot): axes, text and image
        # encoding are what matplotlib does well and we would otherwise write by hand
        "plot": ["matplotlib>=3.7"],
        # GELU, LayerNorm and the causal softmax as numba kernels, one pass over memory
        # each (hpctrain/nn/fused.py): the benchmark GPT's step 5-10% faster, which
        # NumPy's one-operation-a-pass ufuncs cannot give us. Optional: without
        # numba (or with HPCTRAIN_FUSED=0) the NumPy kernels run, and nothing caps NumPy
        # at the releases numba supports unless this extra is asked for
        "fused": ["numba>=0.68"],
    },
    entry_points={
        "console_scripts": [
            "hpctrain = hpctrain.entry:run",
            "hpctrain-prep = data_prep.cli:main",
        ]
    },
)
