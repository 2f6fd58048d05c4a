"""ResNet-18 on Fashion-MNIST with nn.DataParallel: one process drives every GPU.

    python dp_resnet.py              # all GPUs; on a machine without one, the CPU as one device
    python dp_resnet.py --gpus 2

Each step DataParallel copies the model from the first GPU to the others, cuts the batch into one
piece per GPU, runs the pieces in threads of this one process, gathers the outputs on the first
GPU, and sums the gradients back there. Simple to use; see the README for what it costs.
Copy it with common.py and imagenet_recipe.py (the model and the learning-rate recipe).
Lines that exist only because of DataParallel are tagged `# DP:`.
"""
import math, time
import torch
import torch.nn as nn
import torch.nn.functional as F
import common
import imagenet_recipe

def train_step(model, optimizer, X, y, amp):
    optimizer.zero_grad(set_to_none=True)
    with torch.autocast(X.device.type, torch.bfloat16, enabled=amp):
        logits = model(X)   # DP: scatter X, replicate the model, run in parallel, gather logits
        loss = F.cross_entropy(logits, y)
    loss.backward()        # DP: each replica's gradients are summed into the original module
    optimizer.step()
    return loss.detach().float() * len(y), (logits.argmax(1) == y).sum()

def train(args):
    common.check_out_dir(args.out)
    gpus = [torch.device("cuda", i) for i in range(torch.cuda.device_count())][: args.gpus]
    device = gpus[0] if gpus else torch.device("cpu")
    if not gpus:
        print("note: no GPU here, so DataParallel runs the model on the CPU as a single device", flush=True)
    data = common.load_fashion_mnist(args.data_dir, args.train_samples, args.test_samples)
    (X_train, y_train), (X_test, y_test) = data["train"], data["test"]
    if len(y_train) < args.batch_size:
        raise SystemExit(f"error: --batch-size {args.batch_size} is larger than the {len(y_train)} training images")
    memory_format = torch.channels_last if args.channels_last else torch.contiguous_format
    X_train, y_train, X_test, y_test = (t.to(device) for t in (X_train, y_train, X_test, y_test))

    # A new network every run, from the seed: the same initial weights as ddp_resnet.py.
    net = imagenet_recipe.fashion_resnet18(args.seed).to(device, memory_format=memory_format)
    model = nn.DataParallel(net, device_ids=gpus or None)   # DP: the whole change
    lr = imagenet_recipe.scaled_lr(args.lr, args.batch_size)   # --lr is for 256 samples, as in ddp_resnet.py
    optimizer = torch.optim.SGD(imagenet_recipe.param_groups(net, 5e-4), lr=lr, momentum=0.9)   # as ddp_resnet.py
    metrics = common.new_metrics(__file__, args, gpus or [device], "DataParallel", 1, len(y_test))
    # DP: each step's forward broadcasts the weights from the first GPU; backward sums the gradients there
    sent = {f"broadcast ({len(gpus)} GPUs)": common.nbytes(*net.parameters(), *net.buffers()),
            f"reduce_add ({len(gpus)} GPUs)": common.nbytes(*net.parameters())} if len(gpus) > 1 else {}
    print(f"dp_resnet: DataParallel over {[str(d) for d in gpus or [device]]}, batch {args.batch_size}, "
          f"lr {lr:g} ({args.lr:g} x {args.batch_size}/256), constant", flush=True)
    step, start = 0, time.perf_counter()
    for epoch in range(1, args.epochs + 1):
        batches = common.epoch_batches(len(y_train), args.batch_size, args.seed, epoch).to(device)   # as ddp_resnet.py
        last = min(len(batches), (args.max_steps or math.inf) - step)   # where --max-steps may stop this epoch
        progress = common.Progress(epoch, len(batches), True, last=last)
        timer = common.Timer(device)
        totals = torch.zeros(3, device=device)   # summed loss, hits, samples
        net.train()
        for batch_in_epoch, idx in enumerate(batches, 1):
            loss_sum, hits = train_step(model, optimizer, X_train[idx].contiguous(memory_format=memory_format),
                                        y_train[idx], args.amp)
            totals[:2] += torch.stack([loss_sum, hits.float()])
            totals[2] += len(idx)   # a Python number: no host-to-device copy (a GPU sync) per step
            step += 1
            progress(batch_in_epoch)
            if step == args.max_steps:
                break
        seconds = timer()
        net.eval()
        test_acc = common.evaluate(model, X_test, y_test, device)   # DP: the test batches are split too
        common.record_epoch(metrics, epoch, totals, seconds, test_acc, True)
        if step == args.max_steps:
            break
    common.finish(metrics, step, time.perf_counter() - start, net.state_dict(), sent)
    return net

def parse_args(argv=None):
    p = common.base_parser(__file__, __doc__.splitlines()[0], epochs=5, batch_size=256, lr=0.05,
                           resnet=True)
    p.add_argument("--gpus", type=common.positive_int, help="GPUs to use (default: all)")
    args = p.parse_args(argv)
    if args.gpus and args.gpus > torch.cuda.device_count():
        p.error(f"--gpus {args.gpus}: this machine has {torch.cuda.device_count()}")
    return args

def main(argv=None):
    return train(parse_args(argv))

if __name__ == "__main__":
    main()
