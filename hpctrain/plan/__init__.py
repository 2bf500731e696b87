"""The planner: a cluster description (``cluster.py``), its calibration on this machine
(``calibrate.py``), a cost model of each layout (``cost.py``) and the search over
layouts that ``hpctrain plan`` runs (``search.py``)."""
