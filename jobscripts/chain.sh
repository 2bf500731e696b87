#!/bin/bash
# Submit preparation, then training that starts only if preparation succeeded.
#
#   bash jobscripts/chain.sh                      # Shakespeare, then the GPT
#   CONFIG=configs/gpt-shakespeare.toml TRAIN_ARGS="--tp 2" bash jobscripts/chain.sh
#   TRAIN_SCRIPT=job.sbatch bash jobscripts/chain.sh   # a script from `hpctrain slurm render`
#
# Both jobs inherit this environment (sbatch --export=ALL), so the variables of
# prep.sbatch and train.sbatch can be set here. If preparation fails, SLURM cancels the
# training job (--kill-on-invalid-dep) instead of leaving it pending for good with
# "DependencyNeverSatisfied".
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
: "${PREP_SCRIPT:=$here/prep.sbatch}"     # the preparation job's script
: "${TRAIN_SCRIPT:=$here/train.sbatch}"   # the training job's script
prep=$(sbatch --parsable --export=ALL "$PREP_SCRIPT")
prep=${prep%%;*}  # the id alone (a federated cluster appends ";cluster")
train=$(sbatch --parsable --export=ALL --dependency="afterok:$prep" --kill-on-invalid-dep=yes \
  "$TRAIN_SCRIPT")
train=${train%%;*}
echo "prep job $prep, train job $train (starts after $prep succeeds)"
