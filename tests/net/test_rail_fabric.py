"""The emulated rail fabric (scripts/rail-fabric.sh): real namespaces, veth, bridges and tbf."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys

import pytest

from benchmarks.rail_fabric import rate_bytes_per_s
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


RECEIVER = """
import json, socket, sys, time
server = socket.create_server((sys.argv[1], int(sys.argv[2])))
print("ready", flush=True)
conn = server.accept()[0]
first = len(conn.recv(1 << 20))  # the clock starts at the first byte: connecting is not timed
started, received = time.perf_counter(), first
while chunk := conn.recv(1 << 20):
    received += len(chunk)
print(json.dumps({"bytes": received, "timed_bytes": received - first, "seconds": time.perf_counter() - started}))
"""
SENDER = "import socket, sys\nc = socket.create_connection((sys.argv[1], int(sys.argv[2])))\nc.sendall(b'x' * int(sys.argv[3]))\nc.close()"


def transfer_rate(address: str, nbytes: int) -> float:
    """Bytes/s of one TCP stream from rn0 to rn1's `address`, timed inside the receiver from its
    first byte to the last: interpreter start-up and connecting are outside the measurement."""
    receiver = subprocess.Popen([*FABRIC, "exec", "rn1", sys.executable, "-c", RECEIVER, address, "5009"], stdout=subprocess.PIPE, text=True)
    try:
        assert receiver.stdout is not None and receiver.stdout.readline().strip() == "ready"
        in_node("rn0", sys.executable, "-c", SENDER, address, "5009", str(nbytes), check=True)
        result = json.loads(receiver.communicate(timeout=60)[0])
    finally:
        receiver.kill()
    assert result["bytes"] == nbytes and result["timed_bytes"] > nbytes // 2, result
    return result["timed_bytes"] / result["seconds"]


def test_nodes_get_one_shaped_interface_per_rail_and_their_own_hostname(fabric):
    up = fabric("up", "2", "2", "200mbit")
    assert up.returncode == 0, up.stderr
    assert namespaces() == ["hpcrail-fabric", "hpcrail-rn0", "hpcrail-rn1"]
    addresses = in_node("rn1", "ip", "-br", "-4", "addr").stdout
    assert "10.1.0.2/24" in addresses and "10.2.0.2/24" in addresses and "10.100.0.2/24" in addresses
    assert "rate 200Mbit" in in_node("rn1", "tc", "qdisc", "show", "dev", "rail1").stdout
    assert in_node("rn1", "hostname").stdout.strip() == "rn1"
    assert socket.gethostname() != "rn1"  # the caller's namespaces are untouched
    # A stream over rail 0 is held to the rail's rate: shaping is in the path.
    rail_rate = rate_bytes_per_s("200mbit")  # 25 MB/s
    shaped = transfer_rate("10.1.0.2", 8 << 20)  # rail 0
    unshaped = transfer_rate("10.100.0.2", 8 << 20)  # mgmt: the same veth + bridge path, no tbf
    # tbf lets at most its 256 KiB burst through above the rate; TCP/IP headers are counted
    # against the rate too, so the payload rate stays below it.
    assert shaped < 1.1 * rail_rate, f"rail 0 carried {shaped / 1e6:.1f} MB/s, above its {rail_rate / 1e6:.0f} MB/s: not shaped"
    # The same measurement sees a faster link when there is one: the bound above is not met
    # merely because this machine (or the timing) is slow.
    assert unshaped > 2 * shaped, f"mgmt {unshaped / 1e6:.1f} MB/s vs rail 0 {shaped / 1e6:.1f} MB/s"


def test_bad_arguments_are_refused_with_one_line(fabric):
    for args, message in [
        (("up", "1", "2", "200mbit"), "NODES must be 2..32"),
        (("up", "2", "0", "1gbit"), "RAILS must be 1..8"),
        (("up", "2", "2", "fast"), "RATE must look like"),
        (("exec", "rn7", "true"), "node 'rn7' is not up"),
    ]:
        done = fabric(*args)
        assert done.returncode == 2 and done.stderr.strip().startswith("rail-fabric: ") and message in done.stderr, (args, done.stderr)


def test_ranks_in_the_fabric_bind_to_their_rail_and_reduce_correctly(fabric):
    from collectives.mpirun import find_mpirun

    require(find_mpirun() is not None, "mpirun")
    done = subprocess.run(
        [sys.executable, "benchmarks/rail_fabric.py", "--nodes", "2", "--rails", "2", "--rate", "1gbit", "--sizes", "1", "--rounds", "1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    for rank, (node, rail) in enumerate([(0, 0), (0, 1), (1, 0), (1, 1)]):
        assert f"rank {rank} on rn{node}: binding: gpu -, nic rail{rail} (rail {rail})" in done.stdout
        assert f"btl_tcp_if_include=rail{rail}" in done.stdout
    row = next(line for line in done.stdout.splitlines() if line.startswith("| 1 MiB"))
    assert row.split("|")[-2].strip() == "0.0e+00", row  # max error of both allreduces
    assert namespaces() == []  # the benchmark tears the fabric down itself
