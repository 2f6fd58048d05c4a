"""ddp_resnet.py's training rate at two commits, side by side: the one checked out against an earlier one.

    python benchmarks/before_after.py REF [--repeats 3] [--nproc 2]

REF (a commit, tag or branch) is checked out into a temporary git worktree. Each repeat runs both
versions in turn (the machine's drift hits both alike) under torchrun with the same flags and
data, and reads samples/s from each run's metrics.json (the training epochs only: no start-up,
no evaluation). It prints every pair, the medians and their ratio, and each version's copy set:
the files a user copies with the script (those its import lines name, followed to the end).
"""
import argparse, ast, json, os, statistics, subprocess, sys, tempfile, time
HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAGS = ["--train-samples", "1536", "--test-samples", "100", "--batch-size", "64", "--epochs", "1"]


def copy_set(folder, script="ddp_resnet"):
    """The script and the files of `folder` it imports, with their line counts."""
    found, todo = {}, [script]
    while todo:
        name = todo.pop()
        path = os.path.join(folder, name + ".py")
        if name in found or not os.path.isfile(path):
            continue
        found[name] = sum(1 for _ in open(path))
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.Import):
                todo += [alias.name.split(".")[0] for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                todo.append(node.module.split(".")[0])
    return found


def rate(folder, nproc, out):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               "ddp_resnet.py", "--data-dir", os.path.join(HERE, "data"), "--out", out] + FLAGS
    result = subprocess.run(command, cwd=folder, capture_output=True, text=True)
    if result.returncode:
        sys.exit(result.stderr[-2000:])
    return json.load(open(os.path.join(out, "metrics.json")))["samples_per_s"]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("ref", help="the earlier commit")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--nproc", type=int, default=2)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        before = os.path.join(tmp, "before")
        subprocess.run(["git", "worktree", "add", "--detach", before, args.ref], cwd=HERE, check=True,
                       capture_output=True)
        try:
            print(f"torch {__import__('torch').__version__}, {len(os.sched_getaffinity(0))} cores, "
                  f"{time.strftime('%Y-%m-%d')}; ddp_resnet.py {' '.join(FLAGS)}, {args.nproc} ranks")
            for name, folder in (("before", before), ("now", HERE)):
                files = copy_set(folder)
                print(f"copy set {name}: {sum(files.values())} lines in {len(files)} files ("
                      + ", ".join(f"{f}.py {n}" for f, n in sorted(files.items())) + ")")
            rates = {"before": [], "now": []}
            for _ in range(args.repeats):
                for name, folder in (("before", before), ("now", HERE)):
                    rates[name].append(rate(folder, args.nproc, os.path.join(tmp, name)))
                print(f"  before {rates['before'][-1]:6.1f}   now {rates['now'][-1]:6.1f} samples/s", flush=True)
            b, n = statistics.median(rates["before"]), statistics.median(rates["now"])
            print(f"median samples/s: before {b:.1f}, now {n:.1f}: now/before {n / b:.3f}x")
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", before], cwd=HERE, capture_output=True)


if __name__ == "__main__":
    main()
