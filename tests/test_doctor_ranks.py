"""``mpiexec -n N hpctrain doctor``: a problem found on another rank than 0 (another
node's install) is printed by rank 0 with its rank and fails the job; before, rank 0
printed "no problems found" while the job's status was 1."""

from __future__ import annotations

import sys

from hpctrain.doctor import job_problems
from hpctrain.testing import run_mpi


def test_problems_are_listed_once_with_the_ranks_that_have_them():
    assert job_problems([["a"], ["a"]]) == ["a"]
    assert job_problems([[], ["b", "a"], ["b"]]) == ["b (ranks 1, 2)", "a (rank 1)"]
    assert job_problems([[], []]) == []


def test_a_problem_of_rank_1_is_printed_by_rank_0_and_fails_the_job():
    doctor = [sys.executable, "-m", "hpctrain.doctor"]
    done = run_mpi(1, [*doctor, ":", "-n", "1", *doctor, "--expect-mpi", "openmpi"],
                   timeout=120)
    assert done.returncode == 1, (done.returncode, done.stdout, done.stderr)
    problems = [line for line in done.stderr.splitlines() if line.startswith("problem: ")]
    assert len(problems) == 1 and "expected Open MPI" in problems[0], done.stderr
    assert problems[0].endswith("(rank 1)"), problems
    assert "no problems found" not in done.stdout, done.stdout
