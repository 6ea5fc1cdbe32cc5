#!/usr/bin/env bash
# A real Slurm cluster of N network-namespace nodes on this machine (root; Debian's slurmctld,
# slurmd and munge, installed by scripts/setup.sh): up N [--prefix P] | down | env; the prefix
# (default mnslurm) names the cluster. `up` prints the SLURM_CONF to export for srun, sbatch and
# sinfo. The implementation is tests/multinode/slurm_cluster.py (standard library only).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
exec python3 "$ROOT/tests/multinode/slurm_cluster.py" "$@"
