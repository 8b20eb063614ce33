"""All-reduce on two GPUs of one host, the choices for tensor parallelism (issue 15): NCCL and torch's
symmetric-memory one-shot and two-shot reductions (peer memory, no NVLink multicast), eagerly and
captured in CUDA graphs (64 reductions in a graph, as a Llama-3.1-8B decode step does).

    python3 bench/all_reduce_probe.py        # on nvidia-h200-x2; writes $OUT/ar_probe.json

NCCL is captured only after an eager reduction has created its communicator: capturing the first
collective would create it inside the capture.
"""

import json
import os
import threading
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SIZES = [(1, 4096), (8, 4096), (64, 4096), (256, 4096), (1024, 4096), (8192, 4096)]


def timed(fn, iters=200):
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(iters):
        fn()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) * 1000 / iters  # us


def worker(rank, out):
    torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl",
        init_method="tcp://127.0.0.1:29533",
        world_size=2,
        rank=rank,
        device_id=torch.device("cuda", rank),
    )
    res = {
        "env": {
            k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST")
        }
    }
    import torch.distributed._symmetric_memory as symm_mem

    group_name = dist.group.WORLD.group_name
    try:
        symm_mem.enable_symm_mem_for_group(group_name)
    except Exception as exc:
        res["enable_err"] = repr(exc)
    max_numel = max(a * b for a, b in SIZES)
    buf = symm_mem.empty(max_numel, dtype=torch.bfloat16, device=f"cuda:{rank}")
    symm_mem.rendezvous(buf, group_name)
    for m, k in SIZES:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        y = x.clone()
        dist.all_reduce(y)
        row = {"shape": [m, k]}
        row["nccl_us"] = timed(lambda x=x: dist.all_reduce(x.clone()))
        view = buf[: m * k].view(m, k)

        def one_shot(view=view, x=x):
            return torch.ops.symm_mem.one_shot_all_reduce_copy(view, x, "sum", group_name)

        try:
            got = one_shot()
            row["one_shot_err"] = (got.float() - y.float()).abs().max().item()
            row["one_shot_us"] = timed(one_shot)
        except Exception as exc:
            row["one_shot_exc"] = repr(exc)[:300]

        def two_shot(view=view, x=x):
            view.copy_(x)
            return torch.ops.symm_mem.two_shot_all_reduce_(view, "sum", group_name)

        try:
            got = two_shot().clone()
            row["two_shot_err"] = (got.float() - y.float()).abs().max().item()
            row["two_shot_us"] = timed(two_shot)
        except Exception as exc:
            row["two_shot_exc"] = repr(exc)[:300]
        row["clone_us"] = timed(lambda x=x: x.clone())
        res.setdefault("sizes", []).append(row)
    # One-shot inside a CUDA graph: 64 reductions, like a decode step of 32 layers.
    for m in (1, 256):
        x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
        view = buf[: m * 4096].view(m, 4096)
        torch.cuda.synchronize()
        dist.barrier()
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            torch.ops.symm_mem.one_shot_all_reduce_copy(view, x, "sum", group_name)
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        with torch.cuda.graph(g):
            h = x
            for _ in range(64):
                h = torch.ops.symm_mem.one_shot_all_reduce_copy(view, h, "sum", group_name) * 0.5
        x.copy_(torch.randn_like(x))
        torch.cuda.synchronize()
        dist.barrier()
        g.replay()
        torch.cuda.synchronize()
        res[f"graph_one_shot_m{m}_finite"] = bool(torch.isfinite(h).all().item())
        dist.barrier()
        res[f"graph_one_shot_m{m}_us_per_64"] = timed(g.replay, iters=100)

    # NCCL inside a CUDA graph, after the communicator is warm; a watchdog reports a hang.
    def watchdog():
        time.sleep(90)
        res["nccl_graph"] = "hung (no result in 90 s)"
        if rank == 0:
            json.dump(res, open(os.path.join(out, "ar_probe.json"), "w"), indent=1)
        os._exit(3)

    threading.Thread(target=watchdog, daemon=True).start()
    try:
        for m in (1, 256):
            x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
            dist.all_reduce(x)
            torch.cuda.synchronize()
            dist.barrier()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for _ in range(64):
                    dist.all_reduce(x)
                    x.mul_(0.5)
            torch.cuda.synchronize()
            dist.barrier()
            g.replay()
            torch.cuda.synchronize()
            res[f"nccl_graph_m{m}_us_per_64"] = timed(g.replay, iters=50)
        res["nccl_graph"] = "ok"
    except Exception as exc:
        res["nccl_graph"] = repr(exc)[:400]
    if rank == 0:
        json.dump(res, open(os.path.join(out, "ar_probe.json"), "w"), indent=1)
        print(json.dumps(res, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    out = os.environ.get("OUT", ".")
    print(torch.__version__, torch.cuda.device_count(), flush=True)
    mp.spawn(worker, args=(out,), nprocs=2)
