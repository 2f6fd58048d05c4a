"""A two-node SLURM cluster on this one machine, to try examples/slurm_ddp_resnet.sbatch (and
to test it) without a cluster. Needs root and Debian's `slurm-wlm` and `munge` packages.

    sudo python examples/local_slurm.py       # prints the SLURM_CONF to export; Ctrl-C stops it

Both nodes are this host, each with its own slurmd; slurmctld, the state and the logs live in a
temp folder. munged is started if it is not running, with a key made for it if
/etc/munge/munge.key is missing. What was started is stopped on exit, by its pid.

From Python, `LocalSlurm(cluster=SimulatedCluster(2))` puts each node's slurmd (and slurmctld,
on the first) in a node of a simulated cluster: each node then has its own address while the
hostname still resolves to a loopback address, as on many real clusters. `gpus_per_node` makes
SLURM hand out GPUs by count (no devices behind them): what a job that asks for GPUs and sees
none does.
"""
import contextlib, os, pwd, shutil, signal, socket, subprocess, sys, tempfile, time

NEEDED = ("slurmctld", "slurmd", "sbatch", "scontrol", "munged", "munge", "unmunge")


def unavailable():
    """None if a local SLURM can be started here, else the reason in one line."""
    missing = [tool for tool in NEEDED if not shutil.which(tool)]
    if missing:
        return f"local SLURM: {', '.join(missing)} not found (Debian: apt-get install slurm-wlm munge)"
    if os.geteuid() != 0:
        return "local SLURM: needs root (slurmd starts jobs as their users)"
    return None


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalSlurm:
    """`with LocalSlurm() as slurm:` ... `slurm.run("sbatch", ...)`; `slurm.env` has SLURM_CONF."""

    def __init__(self, nodes=2, cpus_per_node=2, cluster=None, gpus_per_node=0):
        self.nodes = [f"node{i + 1}" for i in range(nodes)]
        self.cpus, self.cluster, self.gpus = cpus_per_node, cluster, gpus_per_node
        self.addresses = cluster.addresses if cluster else ["127.0.0.1"] * nodes
        self.daemons, self.munged_pid = [], None

    def __enter__(self):
        self.dir = tempfile.mkdtemp(prefix="local-slurm-")
        try:
            self._start()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc):
        for daemon in self.daemons:
            daemon.terminate()
            try:
                daemon.wait(timeout=20)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()
        if self.munged_pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.munged_pid, signal.SIGTERM)
        shutil.rmtree(self.dir, ignore_errors=True)

    def _start(self):
        self._munge()
        host = socket.gethostname()
        os.makedirs(os.path.join(self.dir, "state"))
        gres = f" Gres=gpu:{self.gpus}" if self.gpus else ""
        nodes = "\n".join(f"NodeName={n} NodeHostname={host} NodeAddr={addr} Port={_free_port()} "
                          f"CPUs={self.cpus} RealMemory=4000{gres}" for n, addr in zip(self.nodes, self.addresses))
        if self.gpus:   # stand-ins for /dev/nvidia*: SLURM counts GPUs by their device files
            for i in range(self.gpus):
                open(os.path.join(self.dir, f"gpu{i}"), "w").close()
            with open(os.path.join(self.dir, "gres.conf"), "w") as f:
                f.write(f"AutoDetect=off\nName=gpu File={self.dir}/gpu[0-{self.gpus - 1}]\n")
        self.conf = os.path.join(self.dir, "slurm.conf")
        with open(self.conf, "w") as f:
            f.write(f"""ClusterName=local
SlurmctldHost={host}({self.addresses[0]})
SlurmctldPort={_free_port()}
SlurmUser=root
AuthType=auth/munge
StateSaveLocation={self.dir}/state
SlurmdSpoolDir={self.dir}/spool.%n
SlurmctldPidFile={self.dir}/slurmctld.pid
SlurmdPidFile={self.dir}/slurmd.%n.pid
SlurmctldLogFile={self.dir}/slurmctld.log
SlurmdLogFile={self.dir}/slurmd.%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
MpiDefault=none
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
{"GresTypes=gpu" if self.gpus else ""}
{nodes}
PartitionName=local Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE State=UP
""")
        self.env = {**os.environ, "SLURM_CONF": self.conf}
        quiet = dict(stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=self.env)
        self.daemons.append(subprocess.Popen(self._on(0, "slurmctld", "-D", "-f", self.conf), **quiet))
        for i, node in enumerate(self.nodes):
            self.daemons.append(subprocess.Popen(self._on(i, "slurmd", "-D", "-f", self.conf, "-N", node), **quiet))
        deadline = time.time() + 60
        while time.time() < deadline:
            if self.idle():
                return
            if any(d.poll() is not None for d in self.daemons):
                break
            time.sleep(0.5)
        logs = "".join(open(os.path.join(self.dir, f)).read()[-1500:] for f in os.listdir(self.dir)
                       if f.endswith(".log"))
        raise RuntimeError(f"local SLURM: the nodes did not come up\n{logs}")

    def _munge(self):
        """munged must run for SLURM's authentication; start it if it does not."""
        if subprocess.run("munge -n | unmunge", shell=True, capture_output=True).returncode == 0:
            return
        key, user = "/etc/munge/munge.key", pwd.getpwnam("munge")
        if not os.path.exists(key):
            with open(key, "wb") as f:
                f.write(os.urandom(1024))
            os.chown(key, user.pw_uid, user.pw_gid)
            os.chmod(key, 0o400)
        for folder in ("/run/munge", "/var/log/munge", "/var/lib/munge"):
            os.makedirs(folder, exist_ok=True)
            os.chown(folder, user.pw_uid, user.pw_gid)
        subprocess.run(["runuser", "-u", "munge", "--", "munged"], check=True, capture_output=True)
        with open("/run/munge/munged.pid") as f:
            self.munged_pid = int(f.read())

    def _on(self, node, *command):
        """The command as run on `node` (in its network namespace, in a simulated cluster)."""
        # nsenter, not `ip netns exec`: that remounts /sys, without the cgroup folder slurmd needs
        return ["nsenter", f"--net=/run/netns/{self.cluster.names[node]}", *command] if self.cluster else list(command)

    def run(self, *command, check=True, cwd=None):
        """A SLURM command (sbatch, scontrol, ...) as typed on the first node."""
        return subprocess.run(self._on(0, *command), env=self.env, capture_output=True, text=True, check=check, cwd=cwd)

    def idle(self):
        """Whether every node is up and runs nothing (a job's last processes are gone)."""
        states = self.run("sinfo", "-h", "-N", "-o", "%T", check=False).stdout.split()
        return len(states) == len(self.nodes) and all(state == "idle" for state in states)

    def job(self, job_id):
        """`scontrol show job` as a dict (JobState, Restarts, ...)."""
        text = self.run("scontrol", "show", "job", "-o", str(job_id)).stdout
        return dict(field.split("=", 1) for field in text.split() if "=" in field)


if __name__ == "__main__":
    problem = unavailable()
    if problem:
        sys.exit(problem)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with LocalSlurm() as slurm:
        print(f"two nodes up. In another shell:\n  export SLURM_CONF={slurm.conf}\n  sinfo\n"
              f"  sbatch examples/slurm_ddp_resnet.sbatch --train-samples 2000 --epochs 2\n"
              f"Ctrl-C stops the cluster.", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            signal.pause()
