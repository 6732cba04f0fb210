"""The emulated rail fabric (scripts/rail-fabric.sh): real namespaces, veth, bridges and tbf."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time

import pytest

from tests.conftest import require
from tests.support.runs import ROOT

FABRIC = ["bash", str(ROOT / "scripts" / "rail-fabric.sh")]
pytestmark = [pytest.mark.net]


def namespaces() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return sorted(line.split()[0] for line in out.splitlines() if line.startswith("hpcrail-"))


@pytest.fixture
def fabric():
    require(os.geteuid() == 0 and shutil.which("ip") is not None and shutil.which("tc") is not None, "root with iproute2 (network namespaces)")
    yield lambda *args: subprocess.run([*FABRIC, *args], capture_output=True, text=True, timeout=120)
    subprocess.run([*FABRIC, "down"], capture_output=True)
    assert namespaces() == []  # down removes everything it created


def in_node(node: str, *command: str, **kwargs) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*FABRIC, "exec", node, *command], capture_output=True, text=True, timeout=60, **kwargs)


def test_nodes_get_one_shaped_interface_per_rail_and_their_own_hostname(fabric):
    up = fabric("up", "2", "2", "200mbit")
    assert up.returncode == 0, up.stderr
    assert namespaces() == ["hpcrail-fabric", "hpcrail-rn0", "hpcrail-rn1"]
    addresses = in_node("rn1", "ip", "-br", "-4", "addr").stdout
    assert "10.1.0.2/24" in addresses and "10.2.0.2/24" in addresses and "10.100.0.2/24" in addresses
    assert "rate 200Mbit" in in_node("rn1", "tc", "qdisc", "show", "dev", "rail1").stdout
    assert in_node("rn1", "hostname").stdout.strip() == "rn1"
    assert socket.gethostname() != "rn1"  # the caller's namespaces are untouched
    # A stream over rail 0 is held to the rail's rate (25 MB/s): shaping is in the path.
    server = subprocess.Popen([*FABRIC, "exec", "rn1", sys.executable, "-c",
                               "import socket; s=socket.create_server(('10.1.0.2', 5009)); c=s.accept()[0]\n"
                               "n=0\nwhile (b:=c.recv(1<<20)): n+=len(b)\nprint(n)"], stdout=subprocess.PIPE, text=True)
    sender = ("import socket,time\nfor _ in range(100):\n  try: c=socket.create_connection(('10.1.0.2',5009)); break\n"
              "  except OSError: time.sleep(0.05)\nt=time.perf_counter(); c.sendall(b'x'*(8<<20)); c.close(); print(time.perf_counter()-t)")
    started = time.perf_counter()
    in_node("rn0", sys.executable, "-c", sender, check=True)
    received = int(server.communicate(timeout=60)[0])
    elapsed = time.perf_counter() - started
    assert received == 8 << 20 and elapsed > 0.8 * (8 << 20) / 25e6, f"{received} bytes in {elapsed:.2f} s: not shaped"


def test_bad_arguments_are_refused_with_one_line(fabric):
    for args, message in [(("up", "1", "2", "200mbit"), "NODES must be 2..32"), (("up", "2", "0", "1gbit"), "RAILS must be 1..8"),
                          (("up", "2", "2", "fast"), "RATE must look like"), (("exec", "rn7", "true"), "node 'rn7' is not up")]:
        done = fabric(*args)
        assert done.returncode == 2 and done.stderr.strip().startswith("rail-fabric: ") and message in done.stderr, (args, done.stderr)


def test_ranks_in_the_fabric_bind_to_their_rail_and_reduce_correctly(fabric):
    from hpc.spec import find_mpirun

    require(find_mpirun() is not None, "mpirun")
    done = subprocess.run([sys.executable, "benchmarks/rail_fabric.py", "--nodes", "2", "--rails", "2", "--rate", "1gbit",
                           "--sizes", "1", "--rounds", "1"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    for rank, (node, rail) in enumerate([(0, 0), (0, 1), (1, 0), (1, 1)]):
        assert f"rank {rank} on rn{node}: binding: gpu -, nic rail{rail} (rail {rail})" in done.stdout
        assert f"btl_tcp_if_include=rail{rail}" in done.stdout
    row = next(line for line in done.stdout.splitlines() if line.startswith("| 1 MiB"))
    assert row.split("|")[-2].strip() == "0.0e+00", row  # max error of both allreduces
    assert namespaces() == []  # the benchmark tears the fabric down itself
