"""PyTorch, unmodified, on the simulated GPU: `torch_capabilities.py CASE...` runs each case in
this process (or, for `ipc`, in worker processes too) and prints one JSON line per case.

    matmul      cuBLAS and cuBLASLt matmuls (float32, bfloat16, a batched matmul, addmm)
    conv        cuDNN convolutions (forward and backward) and batch norm
    train       an MLP trained with AdamW (many cuBLASLt shapes), then SGD
    graph       a CUDA graph capturing a training step with cuBLAS inside, replayed
    compile     torch.compile of a small function (Triton compiles PTX the driver loads)
    green       a green context of 16 SMs (cuGreenCtxCreate) made current, a matmul in it
    expandable  the caching allocator's expandable segments (VMM), then empty_cache
    ipc         DataLoader workers handing CUDA tensors to the main process (IPC handles)
    peer        two GPUs with peer access: copies between them
    oom         allocate past the process's memory, get PyTorch's out-of-memory error, recover
    books       under gpushare: the scheduler's books of this process's group move exactly as
                what the caching allocator holds (memory_reserved) with cached blocks, after
                empty_cache, with a CUDA graph's private pool (run with expandable_segments:True
                too); both from what they were when the case began (the memory cuBLAS and the
                CUDA runtime hold outside the allocator is booked too, and stays put); reads
                `$GPUSHARE_BIN status --json` (GPUSHARE_BIN: the gpushare command)

The simulated GPU times kernels without executing them: nothing here checks a value a kernel
computed, only shapes, what the driver answers, and data that copies move.
"""

import json
import os
import subprocess
import sys
import time

import torch


def emit(case, **fields):
    print(json.dumps({"case": case, **fields}), flush=True)


def matmul():
    a = torch.randn(256, 512, device="cuda")
    b = torch.randn(512, 128, device="cuda")
    c = a @ b
    h = (a.bfloat16() @ b.bfloat16()).float()
    batched = torch.bmm(torch.randn(8, 64, 32, device="cuda"), torch.randn(8, 32, 16, device="cuda"))
    addmm = torch.addmm(torch.zeros(256, 128, device="cuda"), a, b)
    torch.cuda.synchronize()
    emit("matmul", shapes=[list(c.shape), list(h.shape), list(batched.shape), list(addmm.shape)])


def conv():
    import torch.nn as nn

    torch.backends.cudnn.benchmark = False
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.Conv2d(16, 8, 3, stride=2)
    ).cuda()
    x = torch.randn(4, 3, 32, 32, device="cuda", requires_grad=True)
    y = model(x)
    y.sum().backward()
    model.eval()
    z = model(x)
    torch.cuda.synchronize()
    emit("conv", out=list(y.shape), eval_out=list(z.shape), grad=list(x.grad.shape),
         cudnn=torch.backends.cudnn.version())


def mlp(width=512, depth=4):
    import torch.nn as nn

    layers = []
    for i in range(depth):
        layers += [nn.Linear(width if i else 64, width), nn.GELU()]
    layers.append(nn.Linear(width, 10))
    return nn.Sequential(*layers).cuda()


def train():
    model = mlp()
    x, y = torch.randn(128, 64, device="cuda"), torch.randint(0, 10, (128,), device="cuda")
    losses = []
    for opt in (torch.optim.AdamW(model.parameters(), lr=1e-3), torch.optim.SGD(model.parameters(), lr=0.1)):
        for _ in range(5):
            opt.zero_grad(set_to_none=True)
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
    torch.cuda.synchronize()
    emit("train", steps=len(losses))


def graph():
    model = mlp(256, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(64, 64, device="cuda"), torch.randn(64, 10, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # warm-up outside the capture, as PyTorch documents
            opt.zero_grad(set_to_none=True)
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)
    with torch.cuda.graph(g):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
    for _ in range(5):
        g.replay()
    torch.cuda.synchronize()
    emit("graph", replays=5, loss_shape=list(loss.shape))


def compile_case():
    @torch.compile
    def f(a, b):
        return torch.sin(a) * b + a.sum(dim=-1, keepdim=True)

    a, b = torch.randn(64, 32, device="cuda"), torch.randn(64, 32, device="cuda")
    out = f(a, b)
    out2 = f(a + 1, b)
    torch.cuda.synchronize()
    emit("compile", out=list(out.shape), again=list(out2.shape))


def green():
    from torch.cuda.green_contexts import SUPPORTED, GreenContext

    assert SUPPORTED, "this PyTorch has no green contexts"
    g = GreenContext.create(16, 0)
    g.set_context()
    a, b = torch.randn(128, 64, device="cuda"), torch.randn(64, 32, device="cuda")
    c = a @ b
    torch.cuda.synchronize()
    g.pop_context()
    emit("green", sms=16, shape=list(c.shape))


def expandable():
    assert "expandable_segments:True" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""), \
        "run with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
    xs = [torch.empty(n << 20, dtype=torch.uint8, device="cuda") for n in (1, 3, 7, 30, 90)]
    host = torch.arange(1 << 20, dtype=torch.int32)
    dev = host.cuda()
    round_trip = bool(torch.equal(dev.cpu(), host))
    reserved = torch.cuda.memory_reserved()
    del xs, dev
    torch.cuda.empty_cache()
    emit("expandable", round_trip=round_trip, reserved_mib=reserved >> 20,
         after_empty_cache_mib=torch.cuda.memory_reserved() >> 20)


class CudaTensors(torch.utils.data.Dataset):
    """Each item a CUDA tensor a worker process fills by a copy from the host (copies move data
    on the simulated GPU; kernels do not)."""

    def __len__(self):
        return 4

    def __getitem__(self, i):
        return torch.full((1024,), float(i + 1)).to("cuda")


def ipc():
    import torch.multiprocessing as mp

    loader = torch.utils.data.DataLoader(
        CudaTensors(), batch_size=None, num_workers=2, multiprocessing_context=mp.get_context("spawn")
    )
    values = [float(t[-1].item()) if t.is_cuda else None for t in loader]
    emit("ipc", values=sorted(values))


def peer():
    n = torch.cuda.device_count()
    can = torch.cuda.can_device_access_peer(0, 1)
    a = torch.arange(1 << 16, dtype=torch.float32, device="cuda:0")
    b = a.to("cuda:1")
    c = b.to("cuda:0")
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)
    emit("peer", devices=n, can_access_peer=can, round_trip=bool(torch.equal(a.cpu(), c.cpu())))


def oom():
    total = torch.cuda.get_device_properties(0).total_memory
    kept = [torch.empty(total // 4, dtype=torch.uint8, device="cuda") for _ in range(2)]
    error = None
    try:
        kept.append(torch.empty(total, dtype=torch.uint8, device="cuda"))
    except torch.cuda.OutOfMemoryError as e:
        error = type(e).__name__
    del kept
    torch.cuda.empty_cache()
    again = torch.empty(total // 2, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    emit("oom", total=total, error=error, recovered=again.numel() == total // 2)


def books():
    group = os.environ["GPUSHARE_GROUP"]

    def booked():
        out = subprocess.run([os.environ["GPUSHARE_BIN"], "status", "--json"],
                             capture_output=True, check=True, text=True).stdout
        for gpu in json.loads(out)["gpus"]:
            for g in gpu["groups"]:
                if g["name"] == group:
                    return g["memory_used"]
        return None

    points = []
    # Where both stand when the case begins, once the hook gave back its lease's spare (within
    # 40 ms of the last allocation), cuBLAS initialised (it allocates memory of its own, outside
    # the allocator, when PyTorch creates its handle).
    torch.randn(64, 64, device="cuda") @ torch.randn(64, 64, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    time.sleep(0.2)
    reserved0, booked0 = torch.cuda.memory_reserved(), booked()

    def checkpoint(at):
        # Poll until the books settle on what the allocator holds (or 2 s went by).
        torch.cuda.synchronize()
        reserved = torch.cuda.memory_reserved() - reserved0
        deadline = time.monotonic() + 2
        while (got := booked() - booked0) != reserved and time.monotonic() < deadline:
            time.sleep(0.02)
        points.append({"at": at, "reserved": reserved, "booked": got})

    small = torch.empty(1 << 10, device="cuda")
    checkpoint("small block")
    blocks = [torch.empty(n << 20, dtype=torch.uint8, device="cuda") for n in (3, 10, 25, 100)]
    checkpoint("blocks")
    del blocks[1:]
    checkpoint("cached blocks")
    torch.cuda.empty_cache()
    checkpoint("empty_cache")
    a, b = torch.randn(512, 512, device="cuda"), torch.randn(512, 512, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        a @ b  # warm-up outside the capture, as PyTorch documents
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = (a @ b).relu()
        scratch = torch.empty(40 << 20, dtype=torch.uint8, device="cuda")
    g.replay()
    checkpoint("graph private pool")
    del g, out, scratch
    torch.cuda.empty_cache()
    checkpoint("graph freed")
    del small, blocks, a, b
    torch.cuda.empty_cache()
    checkpoint("tensors freed")  # the allocator keeps what PyTorch still holds (cuBLAS's workspaces)
    emit("books", expandable="expandable_segments:True" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
         reserved_at_start=reserved0, booked_at_start=booked0, points=points)


CASES = {"matmul": matmul, "conv": conv, "train": train, "graph": graph, "compile": compile_case,
         "green": green, "expandable": expandable, "ipc": ipc, "peer": peer, "oom": oom,
         "books": books}

if __name__ == "__main__":
    for name in sys.argv[1:]:
        CASES[name]()
