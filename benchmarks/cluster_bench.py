"""Hierarchy and overlap, timed on simulated clusters (examples/simulated_cluster.py: one network namespace
per node, each with its own link of a chosen rate). Needs root; prints why not otherwise.

    python benchmarks/cluster_bench.py            # about 10 minutes on 2 cores

For each link rate it runs benchmarks/cluster_step.py under torchrun in every node and prints
each measured time beside its model:
- ring allreduce of B bytes over W processes: 2(W-1)/W * B / rate + 2(W-1) * alpha, alpha measured
  from a one-float allreduce; hierarchical (N nodes, sums inside a node first): 2(N-1)/N * B per
  node link;
- a step with the allreduce after backward: compute + comm;
- an overlapped step can be no faster than forward + max(backward, comm) + the last bucket's comm;
and the share of the communication that overlap hid: (compute + comm - step) / comm.
Writes runs/cluster_bench/results.json and runs/cluster_bench/step_time.png.
"""
import json, os, socket, subprocess, sys
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "examples")]
import simulated_cluster

OUT = os.path.join(ROOT, "runs", "cluster_bench")
LENET_RATES, RESNET_RATES = (30, 100, 300), (300, 1000)   # Mbit/s where comm is comparable to backward



def free_port():   # port 0: the OS picks one no one listens on now
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

def measure(nodes, procs_per_node, rate_mbit, flags):
    """Run cluster_step.py on a fresh simulated cluster; rank 0's results."""
    with simulated_cluster.SimulatedCluster(nodes, rate_mbit) as cluster:
        port = free_port()
        jobs = [cluster.popen(i, [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nodes}",
                                  f"--nproc_per_node={procs_per_node}", f"--node-rank={i}",
                                  f"--master-addr={cluster.addresses[0]}", f"--master-port={port}",
                                  os.path.join(ROOT, "benchmarks", "cluster_step.py")] + flags,
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                for i in range(nodes)]
        outputs = [job.communicate(timeout=900) for job in jobs]
    if any(job.returncode for job in jobs):
        sys.exit("cluster_step.py failed:\n" + "\n".join(err[-2000:] for _, err in outputs))
    return json.loads(outputs[0][0].strip().splitlines()[-1])


def ring_model(nbytes, senders, rate_mbit, alpha):
    """Seconds for a ring allreduce of nbytes over `senders` that share no link."""
    return 2 * (senders - 1) / senders * nbytes * 8 / (rate_mbit * 1e6) + 2 * (senders - 1) * alpha


def row(label, measured, model):
    ratio = f"{measured / model:5.2f}" if model else "    -"
    model = f"{model * 1000:9.1f}" if model else "        -"
    print(f"  {label:52}{measured * 1000:9.1f}{model}{ratio}", flush=True)


def header(title):
    print(f"\n{title}\n  {'':52}{'ms':>9}{'model':>9}{'ratio':>5}", flush=True)


def main():
    problem = simulated_cluster.unavailable()
    if problem:
        sys.exit(f"{problem}; the cluster benchmark needs it")
    os.makedirs(OUT, exist_ok=True)
    results = {"lenet": {}, "layouts": {}, "resnet": {}}
    print(f"cluster benchmark on {os.cpu_count()} cores; each node's link shaped by tbf; times per step: "
          f"median of 7 means of 10 steps (ResNet: 5 of 2), the variants taking turns", flush=True)

    # --- LeNet, 2 nodes x 1 process: the ring after backward, with --overlap, and DDP (same buckets)
    for rate in LENET_RATES:
        r = results["lenet"][rate] = measure(2, 1, rate, ["--model", "lenet", "--batch-size", "256"])
        comm_model = ring_model(r["bytes"], 2, rate, r["alpha"])
        backward = r["compute"] - r["forward"]
        floor = r["forward"] + max(backward, r["comm"]) + ring_model(r["buckets"][-1], 2, rate, r["alpha"])
        header(f"LeNet (0.52 MB of gradients), 2 nodes x 1 process x 1 replica, {rate} Mbit/s, global batch 256")
        row("compute alone (forward + backward + sgd)", r["compute"], None)
        row("comm alone: ring allreduce of the gradients", r["comm"], comm_model)
        row("scratch: ring after backward", r["after_backward"], r["compute"] + r["comm"])
        row(f"scratch --overlap ({len(r['buckets'])} buckets; model = its floor)", r["overlap"], floor)
        row("DDP, same LeNet and bucket size: compute alone (no_sync)", r["ddp_compute"], None)
        row("DDP: comm alone (gloo allreduce of the gradients)", r["ddp_comm"], comm_model)
        row("DDP: step (model = its floor)", r["ddp"],
            r["forward"] + max(r["ddp_compute"] - r["forward"], r["ddp_comm"])
            + ring_model(r["buckets"][-1], 2, rate, r["alpha"]))
        for name in ("after_backward", "overlap"):
            r[f"hidden_{name}"] = (r["compute"] + r["comm"] - r[name]) / r["comm"]
        r["hidden_ddp"] = (r["ddp_compute"] + r["ddp_comm"] - r["ddp"]) / r["ddp_comm"]   # against its own parts
        print(f"  communication hidden: ring after backward {r['hidden_after_backward']:.0%}, "
              f"--overlap {r['hidden_overlap']:.0%}, DDP {r['hidden_ddp']:.0%}", flush=True)

    # --- hierarchical against flat: 4 replicas in every layout, the same 2 cores
    layouts = [("2 nodes x 1 process x 2 replicas (hierarchical)", 2, 1, 2),
               ("2 nodes x 2 processes (a flat ring of 4)", 2, 2, 1),
               ("4 nodes x 1 process", 4, 1, 1)]
    for rate in LENET_RATES:
        header(f"LeNet, 4 replicas, {rate} Mbit/s per node link: hierarchical against flat")
        for label, nodes, procs, devices in layouts:
            r = results["layouts"].setdefault(label, {})[rate] = measure(
                nodes, procs, rate, ["--model", "lenet", "--batch-size", "256", "--devices", str(devices)])
            # The ring crosses each node link with 2(W-1)/W of the bytes, W = processes in the ring.
            comm_model = ring_model(r["bytes"], nodes * procs, rate, r["alpha"])
            row(f"{label}: comm", r["comm"], comm_model)
            row(f"{label}: step", r["after_backward"], r["compute"] + comm_model)

    # --- DDP on ResNet-18: default buckets (overlap) against one bucket (after backward)
    for rate in RESNET_RATES:
        r = results["resnet"][rate] = measure(2, 1, rate, ["--model", "resnet", "--batch-size", "64",
                                                           "--warmup", "2", "--steps", "2", "--repeats", "5"])
        comm_model = ring_model(r["bytes"], 2, rate, r["alpha"])
        header(f"ResNet-18 ({r['bytes'] / 1e6:.1f} MB of gradients), DDP, 2 nodes x 1 process, "
               f"32 images per rank, {rate} Mbit/s")
        row("compute alone (no_sync)", r["compute"], None)
        row("comm alone: one allreduce of all gradients", r["comm"], comm_model)
        row("DDP, one bucket (allreduce after backward)", r["ddp_one_bucket"], r["compute"] + r["comm"])
        row("DDP, default 25 MB buckets (overlap)", r["ddp"], r["compute"] + r["comm"])
        for name in ("ddp", "ddp_one_bucket"):
            r[f"hidden_{name}"] = (r["compute"] + r["comm"] - r[name]) / r["comm"]
        print(f"  communication hidden: one bucket {r['hidden_ddp_one_bucket']:.0%}, "
              f"default buckets {r['hidden_ddp']:.0%}", flush=True)

    json.dump(results, open(os.path.join(OUT, "results.json"), "w"), indent=1)
    plot(results, [label for label, *_ in layouts], os.path.join(OUT, "step_time.png"))
    print(f"\nwrote {os.path.relpath(OUT, ROOT)}/results.json and step_time.png", flush=True)


def plot(results, layouts, path):
    """Step time against link rate, one line per approach (JSON keys are strings once reloaded)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    at = lambda table, rate: table.get(rate, table.get(str(rate)))
    fig, (ax_lenet, ax_layout, ax_resnet) = plt.subplots(1, 3, figsize=(14, 4))
    for name, label in (("after_backward", "scratch, ring after backward"), ("overlap", "scratch --overlap"),
                        ("ddp", "DDP"), ("compute", "compute alone")):
        ax_lenet.plot(LENET_RATES, [at(results["lenet"], r)[name] * 1000 for r in LENET_RATES], "o-", label=label)
    for label in layouts:
        ax_layout.plot(LENET_RATES, [at(results["layouts"][label], r)["after_backward"] * 1000 for r in LENET_RATES],
                       "o-", label=label)
    for name, label in (("ddp_one_bucket", "DDP, one bucket"), ("ddp", "DDP, default buckets"),
                        ("compute", "compute alone")):
        ax_resnet.plot(RESNET_RATES, [at(results["resnet"], r)[name] * 1000 for r in RESNET_RATES], "o-", label=label)
    for ax, title, rates in ((ax_lenet, "LeNet, 2 nodes x 1 process", LENET_RATES),
                             (ax_layout, "LeNet, 4 replicas", LENET_RATES),
                             (ax_resnet, "ResNet-18, DDP, 2 nodes", RESNET_RATES)):
        ax.set(xscale="log", xlabel="link rate per node (Mbit/s)", ylabel="ms per step", title=title)
        ax.set_xticks(rates, [str(r) for r in rates])
        ax.minorticks_off()
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
