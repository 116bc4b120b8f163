"""Nothing assumes one host: replicas over MPI's network transport, launched with a host file.

The 4-rank replicas test (2 stages x 2 replicas and 1 x 4, equal to
Sequential) runs with shared memory switched off (``MPIR_CVAR_NOLOCAL``), so
every message goes through libfabric's TCP provider on the loopback
interface, as between hosts; the launch uses a host file, and each rank
names its host (``KERAS_PIPE_HOST``: a, b, a, b, as round-robin placement
over two nodes gives), so the pipelines must form from ranks 0 and 2, and 1
and 3. MPICH's own summary shows the transport.
"""

import json

import pytest
from mpi import mpirun_path, run_mpi

MPICH_OVER_LOOPBACK_TCP = {
    "MPIR_CVAR_NOLOCAL": "1",  # no shared memory: every rank acts as if on another node
    "MPIR_CVAR_CH4_NETMOD": "ofi",
    "FI_PROVIDER": "tcp",
    "FI_TCP_IFACE": "lo",
    "MPIR_CVAR_DEBUG_SUMMARY": "1",  # rank 0 prints the transport it chose
}


def _is_mpich() -> bool:
    import subprocess

    version = subprocess.run([mpirun_path(), "--version"], capture_output=True, text=True, timeout=60).stdout
    return "HYDRA" in version.upper()


@pytest.mark.skipif(not _is_mpich(), reason="the loopback transport settings are MPICH's")
def test_replicas_over_loopback_tcp_with_a_host_file(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost:4\n")
    hosts = ["a", "b", "a", "b"]
    launch = run_mpi(
        4,
        "replicas.py",
        "3",  # micro-batches: m = 1 as well is test_replicas.py's, over shared memory
        timeout=900,
        # (the 2 x 2 layout alone, the one the hosts place: 1 x 4 over shared memory is test_replicas.py's on 2)
        env={**MPICH_OVER_LOOPBACK_TCP, "EXPECT_PIPELINES": json.dumps([[0, 2], [1, 3]]), "REPLICA_STAGES": "2"},
        mpirun_args=("-f", str(hostfile)),
        rank_env=[{"KERAS_PIPE_HOST": host} for host in hosts],
    )
    assert launch.returncode == 0, launch.output
    assert "libfabric provider: tcp - 127.0.0.1" in launch.output, launch.output[:3000]
    assert launch.output.count("REPLICAS OK") == 4, launch.output
    assert "replica 0: stage 0: rank 0 (a), stage 1: rank 2 (a)" in launch.output, launch.output
