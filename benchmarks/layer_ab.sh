#!/usr/bin/env bash
# Before/after of the layer bench: BASE (a commit) against the working tree, ROUNDS rounds, the two
# trees alternating (one interleaved run per tree per round), fraction of dense and the rest of the
# table per case. The base is checked out as a detached git worktree beside the repository and each
# run imports its own tree (PYTHONPATH), with this repository's .venv.
#   bash benchmarks/layer_ab.sh BASE [ROUNDS]      e.g. bash benchmarks/layer_ab.sh b275c04 3
set -euo pipefail
base=${1:?usage: bash benchmarks/layer_ab.sh BASE [ROUNDS]}
rounds=${2:-3}
here=$(cd "$(dirname "$0")/.." && pwd)
before=$(mktemp -d)/before
git -C "$here" worktree add --detach "$before" "$base" >/dev/null
trap 'git -C "$here" worktree remove --force "$before"' EXIT
for round in $(seq "$rounds"); do
  for tree in "$before" "$here"; do
    echo "== round $round: $tree $(git -C "$tree" rev-parse --short HEAD)"
    (cd "$tree" && PYTHONPATH="$tree" "$here/.venv/bin/python" -m shardmoe bench --shapes e8 fine --dtype both \
       --threads 2 --repeats 5 --candidates transformers dense shardmoe 2>&1 | grep -E "^\[|dense  |shardmoe  |transformers  ")
  done
done
