"""mpidl.comm.shared without MPI: the stderr filter around the window's allocation.

The shared window itself is tested on real ranks (tests/mpi/test_comm.py).
"""
import os

from mpidl.comm.shared import _without_spurious_ucx_error


def test_only_open_mpis_spurious_ucx_message_is_filtered_from_stderr(capfd):
    with _without_spurious_ucx_error():
        os.write(2, b"[vm:1] /openmpi-5.0.11/ompi/mca/osc/ucx/osc_ucx_component.c:375  "
                    b"Error: OSC UCX component priority set inside component query failed \n \n")
        os.write(2, b"a real problem\n")
    assert capfd.readouterr().err == "a real problem\n"
