# shellcheck shell=bash
# Site settings sourced by every template in slurm/ (`mpidl sbatch` inlines this file
# into the scripts it renders, after the site profile's settings).
#
# Set these before submitting (sbatch passes the submitting environment on to the
# job), or let a profile in hpc/profiles/ set them:
#   MPIDL_MODULES     modules to load, space-separated        ("gcc/12 openmpi/5")
#   MPIDL_VENV        a virtual environment to activate in the job
#   MPIDL_PYTHON      the python that runs mpidl; default: the environment the job was
#                     submitted from ($VIRTUAL_ENV, else python3 on PATH)
#   MPIDL_SRUN_FLAGS  extra flags for every srun step         ("--cpu-bind=cores")
#   MPIDL_SRUN_MPI    srun's --mpi plugin, the PMI the site MPI speaks: pmix (default:
#                     Open MPI, HPC-X), pmi2 (MPICH, MVAPICH, Intel MPI), cray_shasta
#                     (HPE Cray MPICH), pmix_v3/v4/v5; `srun --mpi=list` shows the site's
#   MPIDL_PMI_LIBRARY Intel MPI under srun: Slurm's PMI library for that plugin
#                     (libpmi2.so for pmi2, libpmix.so for pmix), as I_MPI_PMI_LIBRARY
#   MPIDL_PPN, MPIDL_DEPTH, MPIDL_PALS_FLAGS, MPIDL_MPIEXEC
#                     PBS with HPE PALS (train_pals.pbs): ranks per node, cores per
#                     rank (mpiexec --ppn, --depth), extra mpiexec flags, and PALS's
#                     mpiexec where another is first on PATH (a venv with the [mpi] extra)
#
# Provides to the templates:
#   MPIDL_PYTHON        checked to import mpidl
#   OMP_NUM_THREADS     = --cpus-per-task, or PALS's depth (1 when not given); also for
#                       OpenBLAS/MKL
#   mpidl_srun ARGS     srun --mpi=$MPIDL_SRUN_MPI $MPIDL_SRUN_FLAGS ARGS
#   mpidl_pals ARGS     PALS's mpiexec -n NODES*PPN --ppn PPN --depth DEPTH --cpu-bind depth
#   mpidl_job_start     prints the job's header and `mpidl info` (one line `ranks: N`)

# ---- site: MPI, UCX and PMIx knobs (uncomment what your cluster needs) ------------
# InfiniBand through UCX with Open MPI:
#   export OMPI_MCA_pml=ucx
#   export UCX_TLS=rc,sm,self            # add cuda_copy,cuda_ipc for GPU buffers
#   export UCX_NET_DEVICES=mlx5_0:1
# Open MPI 5 with Slurm's PMIx: silence "gds/shmem" warnings on some sites:
#   export PMIX_MCA_gds=hash
# CUDA-aware MPI (hpc.gpu probes it; this only forces the answer):
#   export MPIDL_CUDA_AWARE=1
# UCX warns about every UCX_* variable a transport does not use; that is noise here.
export UCX_WARN_UNUSED_ENV_VARS=${UCX_WARN_UNUSED_ENV_VARS:-n}
# ------------------------------------------------------------------------------------

# Modules. Batch shells are not login shells, so `module` may be undefined; the init
# scripts of Lmod and Environment Modules read unset variables, hence set +u around.
if [[ -n ${MPIDL_MODULES:-} ]]; then
    set +u
    if ! type module >/dev/null 2>&1; then
        for init in /etc/profile.d/lmod.sh /etc/profile.d/modules.sh \
            /usr/share/lmod/lmod/init/bash /usr/share/modules/init/bash; do
            # shellcheck disable=SC1090  # a site file, not ours to lint
            if [[ -f $init ]]; then source "$init" && break; fi
        done
    fi
    read -ra mpidl_modules <<<"$MPIDL_MODULES"
    module load "${mpidl_modules[@]}"
    set -u
fi

if [[ -n ${MPIDL_VENV:-} ]]; then
    if [[ ! -f $MPIDL_VENV/bin/activate ]]; then
        echo "env.sh: MPIDL_VENV=$MPIDL_VENV has no bin/activate; create it with" \
            "'python3 -m venv $MPIDL_VENV' and install mpidl there" >&2
        exit 2
    fi
    set +u
    # shellcheck disable=SC1091  # created by python -m venv
    source "$MPIDL_VENV/bin/activate"
    set -u
fi

# The Python environment the job was submitted from, unless told otherwise. A module
# loaded above may put its own python3 first on PATH, so an active venv wins.
if [[ -z ${MPIDL_PYTHON:-} ]]; then
    if [[ -n ${VIRTUAL_ENV:-} && -x $VIRTUAL_ENV/bin/python ]]; then
        MPIDL_PYTHON=$VIRTUAL_ENV/bin/python
    else
        MPIDL_PYTHON=$(command -v python3 || command -v python || true)
    fi
fi
export MPIDL_PYTHON
if [[ -z $MPIDL_PYTHON ]] || ! "$MPIDL_PYTHON" -c 'import mpidl' 2>/dev/null; then
    echo "env.sh: python '${MPIDL_PYTHON:-<none found>}' cannot import mpidl." \
        "Submit from the environment where mpidl is installed, or set MPIDL_PYTHON" \
        "(or MPIDL_VENV) to one that has it." >&2
    exit 2
fi

# One rank per task, each using the CPUs Slurm (or PALS's --depth) gave it.
export OMP_NUM_THREADS=${SLURM_CPUS_PER_TASK:-${MPIDL_DEPTH:-${OMP_NUM_THREADS:-1}}}
export OPENBLAS_NUM_THREADS=$OMP_NUM_THREADS MKL_NUM_THREADS=$OMP_NUM_THREADS
# From Slurm 22.05 srun no longer inherits sbatch's --cpus-per-task; this restores it.
if [[ -n ${SLURM_CPUS_PER_TASK:-} ]]; then
    export SRUN_CPUS_PER_TASK=$SLURM_CPUS_PER_TASK
fi
# Rank output reaches the log as it happens, interleaved in time order.
export PYTHONUNBUFFERED=1

read -ra mpidl_srun_flags <<<"${MPIDL_SRUN_FLAGS:-}"
read -ra mpidl_pals_flags <<<"${MPIDL_PALS_FLAGS:-}"

# srun's PMI plugin must be the one the MPI speaks: with any other (or none) every task
# initialises MPI alone, a world of size 1, and `mpidl` refuses the launch (exit 2).
# The Open MPI 5 of mpidl's [mpi] extra speaks only PMIx; MPICH's pmi2; Cray MPICH
# Cray PMI (cray_shasta); Intel MPI the PMI library named by I_MPI_PMI_LIBRARY.
MPIDL_SRUN_MPI=${MPIDL_SRUN_MPI:-pmix}
case $MPIDL_SRUN_MPI in
    pmix | pmix_v[345] | pmi2 | cray_shasta) ;;
    *)
        echo "env.sh: MPIDL_SRUN_MPI=$MPIDL_SRUN_MPI is not an srun --mpi plugin an MPI" \
            "job can start with; use pmix (Open MPI, HPC-X), pmi2 (MPICH, MVAPICH, Intel" \
            "MPI) or cray_shasta (HPE Cray MPICH); srun --mpi=list shows this site's" >&2
        exit 2
        ;;
esac
if [[ -n ${MPIDL_PMI_LIBRARY:-} ]]; then
    if [[ ! -f $MPIDL_PMI_LIBRARY ]]; then
        echo "env.sh: MPIDL_PMI_LIBRARY=$MPIDL_PMI_LIBRARY does not exist on" \
            "$(hostname); name Slurm's PMI library for srun --mpi=$MPIDL_SRUN_MPI" \
            "(libpmi2.so for pmi2, libpmix.so for pmix; ask your site where it lives)" >&2
        exit 2
    fi
    export I_MPI_PMI_LIBRARY=$MPIDL_PMI_LIBRARY
fi

mpidl_srun() {
    srun --mpi="$MPIDL_SRUN_MPI" "${mpidl_srun_flags[@]}" "$@"
}

# PBS with HPE PALS (ALCF's Polaris and Aurora): PALS's mpiexec runs PPN ranks on every
# node of the job, each bound to DEPTH cores. It rejects Open MPI's options.
mpidl_pals() {
    local nodes
    nodes=$(sort -u "${PBS_NODEFILE:?PBS_NODEFILE is not set: mpidl_pals runs in a PBS job}" |
        wc -l)
    "${MPIDL_MPIEXEC:-mpiexec}" -n $((nodes * ${MPIDL_PPN:-1})) --ppn "${MPIDL_PPN:-1}" \
        --depth "${MPIDL_DEPTH:-1}" --cpu-bind depth \
        --env OMP_NUM_THREADS="$OMP_NUM_THREADS" "${mpidl_pals_flags[@]}" "$@"
}

mpidl_job_start() {
    if [[ -n ${PBS_JOBID:-} && -z ${SLURM_JOB_ID:-} ]]; then
        echo "=== job $PBS_JOBID (${PBS_JOBNAME:-}), $(date -Is)," \
            "$(sort -u "$PBS_NODEFILE" | wc -l) node(s), ${MPIDL_PPN:-1} rank(s) per node," \
            "depth ${MPIDL_DEPTH:-1}, ${OMP_NUM_THREADS} thread(s) per rank"
        echo "=== python: $MPIDL_PYTHON"
        mpidl_pals "$MPIDL_PYTHON" -m mpidl info
        return
    fi
    echo "=== job ${SLURM_JOB_ID:-none} (${SLURM_JOB_NAME:-}) attempt" \
        "$((${SLURM_RESTART_COUNT:-0} + 1)), $(date -Is)," \
        "${SLURM_JOB_NUM_NODES:-1} node(s) ${SLURM_JOB_NODELIST:-$(hostname)}," \
        "${SLURM_NTASKS:-1} task(s), ${OMP_NUM_THREADS} thread(s) per task"
    echo "=== python: $MPIDL_PYTHON"
    # --overlap: the next step need not wait for Slurm to release this one's CPUs
    # ("step creation temporarily disabled, requested nodes are busy").
    mpidl_srun --overlap "$MPIDL_PYTHON" -m mpidl info
}
