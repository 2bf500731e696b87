#!/bin/bash
# Submit preparation, then training that starts only if preparation succeeded.
#
#   bash jobscripts/chain.sh                      # Shakespeare, then the GPT
#   CONFIG=configs/gpt-shakespeare.toml TRAIN_ARGS="--tp 2" bash jobscripts/chain.sh
#
# Both jobs inherit this environment (sbatch --export=ALL), so the variables of
# prep.sbatch and train.sbatch can be set here.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
prep=$(sbatch --parsable --export=ALL "$here/prep.sbatch")
train=$(sbatch --parsable --export=ALL --dependency="afterok:$prep" "$here/train.sbatch")
echo "prep job $prep, train job $train (starts after $prep succeeds)"
