"""What ft_ddp_resnet.py's coordinator does per step as the membership grows: messages, bytes and
CPU seconds per step with 8, 64 and 512 members that train nothing (stubs that join, ask for a
quorum and vote, as members do, in one process of this file).

    python benchmarks/ft_scale.py [--members 8 64 512] [--steps 30]

The coordinator runs as the README starts it (its own process, on this machine's loopback). Each
step every stub sends its vote (which also asks for the next quorum) and reads the commit and the
quorum; the beats the coordinator sends every second are counted too. CPU: the coordinator's user
+ system time over all measured steps (/proc), divided by their number.
"""
import argparse, json, os, socket, statistics, subprocess, sys, time
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from ft_ddp_resnet import proof

SECRET = "scale-benchmark"



def free_port():   # port 0: the OS picks one no one listens on now
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

def cpu_seconds(pid):
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")   # utime + stime


class Stub:
    """One member that trains nothing: a socket, and counts of what went through it."""
    def __init__(self, address, flags):
        self.sock, self.buffer = socket.create_connection(address), b""
        self.sent = self.received = self.messages_in = self.messages_out = 0
        challenge = self.read()["challenge"]
        answer = self.ask({"op": "join", "proof": proof(SECRET.encode(), challenge), "challenge": "c" * 32,
                           "flags": flags, "step": 0, "run": None})
        assert "id" in answer, answer

    def send(self, message):
        data = (json.dumps(message) + "\n").encode()
        self.sock.sendall(data)
        self.sent, self.messages_out = self.sent + len(data), self.messages_out + 1

    def read(self):
        """The next message that is not a beat (beats are counted)."""
        while True:
            while b"\n" not in self.buffer:
                self.buffer += self.sock.recv(65536)
            line, self.buffer = self.buffer.split(b"\n", 1)
            self.received, self.messages_in = self.received + len(line) + 1, self.messages_in + 1
            message = json.loads(line)
            if "beat" not in message:
                return message

    def ask(self, message):
        self.send(message)
        return self.read()


def measure(members, steps):
    port = free_port()
    address = ("127.0.0.1", port)
    env = {**os.environ, "FT_SECRET": SECRET}
    coordinator = subprocess.Popen([sys.executable, "ft_ddp_resnet.py", "--serve", f"127.0.0.1:{port}",
                                    "--store-port", str(free_port()), "--member-timeout", "600"], cwd=ROOT, env=env,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        flags = {"min_members": members, "final_step": 10 ** 9}
        for _ in range(300):
            try:
                socket.create_connection(address).close()
                break
            except OSError:
                time.sleep(0.1)
        stubs = [Stub(address, flags) for _ in range(members)]   # one at a time: each proves itself, asks for a quorum
        for stub in stubs:
            assert stub.read()["world"] == members
        samples, cpu_start, wall_start = [], cpu_seconds(coordinator.pid), time.perf_counter()
        for step in range(steps):
            before = [(s.sent, s.received, s.messages_in, s.messages_out) for s in stubs]
            cpu, wall = cpu_seconds(coordinator.pid), time.perf_counter()
            for stub in stubs:
                stub.send({"op": "vote", "step": step, "ok": True, "next": True, "waited": 0.0, "error": ""})
            for stub in stubs:
                assert stub.read() == {"commit": True}
                assert stub.read()["step"] == step + 1
            wall, cpu = time.perf_counter() - wall, cpu_seconds(coordinator.pid) - cpu
            after = [(s.sent, s.received, s.messages_in, s.messages_out) for s in stubs]
            totals = [sum(a[k] - b[k] for a, b in zip(after, before)) for k in range(4)]
            samples.append((wall, cpu, *totals))
        cpu_total, wall_total = cpu_seconds(coordinator.pid) - cpu_start, time.perf_counter() - wall_start
        for stub in stubs:
            stub.sock.close()
    finally:
        coordinator.kill()
        coordinator.wait()
    median = [statistics.median(column) for column in zip(*samples)]
    measured = dict(zip(("wall_s", "cpu_s", "bytes_in", "bytes_out", "messages_in", "messages_out"), median))
    return {**measured, "wall_s": wall_total / steps, "cpu_s": cpu_total / steps}   # /proc counts in 10 ms ticks


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--members", type=int, nargs="+", default=[8, 64, 512])
    p.add_argument("--steps", type=int, default=30)
    args = p.parse_args()
    print(f"per step: wall and CPU averaged over {args.steps} steps, messages and bytes their median (in and out "
          f"as the coordinator sees them, beats included)")
    print(f"{'members':>8} {'wall ms':>9} {'coord CPU ms':>13} {'msgs in':>8} {'msgs out':>9} "
          f"{'bytes in':>9} {'bytes out':>10} {'out bytes/member':>17}")
    for n in args.members:
        m = measure(n, args.steps)
        print(f"{n:>8} {m['wall_s'] * 1e3:>9.1f} {m['cpu_s'] * 1e3:>13.1f} {m['messages_out']:>8.0f} "
              f"{m['messages_in']:>9.0f} {m['bytes_out']:>9.0f} {m['bytes_in']:>10.0f} {m['bytes_in'] / n:>17.1f}",
              flush=True)


if __name__ == "__main__":
    main()
