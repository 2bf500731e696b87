"""``hpctrain-prep``: real datasets into partitioned HDF5 (see ``data_prep.cli``).

``sources`` reads the raw data, ``write`` writes the dataset files, ``partition``
splits them into shards and a manifest, ``verify`` and ``describe`` check and show them.
"""
