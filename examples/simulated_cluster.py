"""A cluster in a box: several "machines" on one Linux host, each with its own address and its
own network link of a chosen rate, so that multi-node training can be run and timed without a
cluster. Needs root (or CAP_NET_ADMIN) and the `ip` and `tc` commands; `ethtool` is used too.

    python examples/simulated_cluster.py --nodes 2 --rate-mbit 300 -- \\
        torchrun --nnodes=2 --nproc_per_node=1 --node-rank={node} --master-addr={head} \\
                 --master-port=29500 ddp_toy.py

runs the command once in every node ({node}: its index, {addr}: its address, {head}: node 0's
address) and waits for all of them. The layout, all of it in namespaces of its own (the host's
own network is never touched):

    node 0 [eth0 10.99.0.1, tbf] --veth--+
    node 1 [eth0 10.99.0.2, tbf] --veth--+-- bridge, in a "switch" namespace
    ...

Each node's `eth0` sends through a token bucket (`tc ... tbf`) of the chosen rate: the node's
link to the switch. Processes inside one node talk over that node's own loopback, as the
processes of one machine do. `netem` (delay emulation) is not in every kernel; `tbf` is.

gloo inside a node needs GLOO_SOCKET_IFNAME=eth0: without it gloo resolves the hostname to
127.0.0.1 and advertises that to its peers (real clusters hit the same). `env()` sets it.
"""
import argparse, contextlib, os, shutil, signal, subprocess, sys, threading, time, uuid

SUBNET = "10.99.0"   # private to this cluster's bridge: two clusters at once never see each other


def unavailable():
    """None if a cluster can be made here, else the reason in one line."""
    if sys.platform != "linux":
        return "simulated cluster: needs Linux network namespaces"
    missing = [tool for tool in ("ip", "tc", "ethtool") if not shutil.which(tool)]
    if missing:
        return f"simulated cluster: needs the {', '.join(missing)} command(s) (Debian: iproute2, ethtool)"
    if os.geteuid() != 0:
        return "simulated cluster: needs root (or CAP_NET_ADMIN) to create network namespaces"
    probe = f"dpc-probe-{uuid.uuid4().hex[:8]}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"simulated cluster: cannot create a network namespace ({made.stderr.strip()})"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args):
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


class SimulatedCluster:
    """`with SimulatedCluster(2, rate_mbit=100) as cluster:` makes the nodes; leaving the block
    (normally, on an error or on Ctrl-C) stops what was started in them and deletes them."""

    def __init__(self, nodes, rate_mbit=None):
        self.nodes, self.rate_mbit = nodes, rate_mbit
        tag = f"{os.getpid()}-{uuid.uuid4().hex[:6]}"   # two runs at once never share a name
        self.switch = f"dpc{tag}-switch"
        self.names = [f"dpc{tag}-node{i}" for i in range(nodes)]
        self.addresses = [f"{SUBNET}.{i + 1}" for i in range(nodes)]
        self.processes = []

    def __enter__(self):
        # A polite kill (SIGTERM) ends the block like Ctrl-C does, so the nodes are deleted then too.
        self.previous_handler = None
        if threading.current_thread() is threading.main_thread():
            self.previous_handler = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
        try:
            self._create()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc):
        self._delete()
        if self.previous_handler is not None:
            signal.signal(signal.SIGTERM, self.previous_handler)

    def _create(self):
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for i, (name, address) in enumerate(zip(self.names, self.addresses)):
            _ip("netns", "add", name)
            _ip("-n", name, "link", "set", "lo", "up")
            # A cable: eth0 in the node, its other end plugged into the switch's bridge.
            _ip("-n", name, "link", "add", "eth0", "type", "veth", "peer", "name", f"port{i}", "netns", self.switch)
            _ip("-n", self.switch, "link", "set", f"port{i}", "master", "br0", "up")
            _ip("-n", name, "addr", "add", f"{address}/24", "dev", "eth0")
            _ip("-n", name, "link", "set", "eth0", "up")
            if self.rate_mbit:
                # Segmentation offloads hand tbf 64 KB super-packets, which then need a burst that
                # large; after an idle gap (a compute phase) such a burst leaves at full speed. Off,
                # a 16 KB burst keeps the rate exact for every message.
                self.run(i, ["ethtool", "-K", "eth0", "gso", "off", "tso", "off", "gro", "off"])
                self.run(i, ["tc", "qdisc", "add", "dev", "eth0", "root", "tbf", "rate",
                             f"{self.rate_mbit}mbit", "burst", "16kb", "latency", "100ms"])

    def _delete(self):
        # Every process inside a node, whoever started it (torchrun starts its workers in sessions
        # of their own, so a process group would miss them): `ip netns pids` lists them. Those
        # started here are killed by pid as well: one just started may not have entered its node
        # yet. Listed again until none is left, as a process may start another meanwhile.
        for p in self.processes:
            with contextlib.suppress(ProcessLookupError):
                p.kill()
        for _ in range(100):
            pids = [int(pid) for name in self.names for pid in
                    subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout.split()]
            if not pids:
                break
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.05)
        for p in self.processes:
            p.wait()
        for name in self.names + [self.switch]:   # deleting a node also removes its cable
            subprocess.run(["ip", "netns", "del", name], capture_output=True)

    def env(self, **extra):
        """The environment for a process in a node: gloo on the node's own interface."""
        return {**os.environ, "GLOO_SOCKET_IFNAME": "eth0", **extra}

    def run(self, node, command, **kwargs):
        """Run a command inside node `node` and wait for it (check=True)."""
        return subprocess.run(["ip", "netns", "exec", self.names[node], *command], check=True,
                              capture_output=True, text=True, **kwargs)

    def popen(self, node, command, **kwargs):
        """Start a command inside node `node`; it and its children are stopped when the cluster is deleted."""
        kwargs.setdefault("env", self.env())
        process = subprocess.Popen(["ip", "netns", "exec", self.names[node], *command], **kwargs)
        self.processes.append(process)
        return process


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--nodes", type=int, default=2, help="simulated machines")
    p.add_argument("--rate-mbit", type=float, help="each node's link rate in Mbit/s (default: unlimited)")
    p.add_argument("command", nargs=argparse.REMAINDER,
                   help="after --: the command to run in every node; {node}, {addr}, {head} are filled in")
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        p.error("give the command to run in every node after --")
    problem = unavailable()
    if problem:
        sys.exit(problem)
    with SimulatedCluster(args.nodes, args.rate_mbit) as cluster:
        jobs = [cluster.popen(i, [part.format(node=i, addr=cluster.addresses[i], head=cluster.addresses[0])
                                  for part in command]) for i in range(args.nodes)]
        codes = [job.wait() for job in jobs]
    sys.exit(max(codes, key=abs))


if __name__ == "__main__":
    main()
