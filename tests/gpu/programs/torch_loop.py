"""PyTorch loops for compute shares and overhead.

    python3 torch_loop.py matmul --seconds S [--size N]
        bf16 matrix products back to back; products per second.
    python3 torch_loop.py train --chunks C [--steps-per-chunk K]
        a small MLP's training step (forward, backward, AdamW); the median
        step time over C chunks of K steps, each chunk synchronised.
    python3 torch_loop.py cost --chunks C [--steps-per-chunk K]
        three steps timed in one process, for the shim's cost on each kind
        of work: the training step above, a step bound by cuBLAS (four bf16
        products of 8192), and a step bound by launches (400 element-wise
        kernels on 1024 numbers); each the median over C chunks of K steps.
"""

import argparse
import statistics
import time

from handshake import ready_then_wait_for_go, report_and_hold


def matmul(args) -> dict:
    import torch

    a = torch.randn(args.size, args.size, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(args.size, args.size, device="cuda", dtype=torch.bfloat16)
    for _ in range(10):
        c = a @ b
    torch.cuda.synchronize()
    ready_then_wait_for_go()
    start = time.monotonic()
    end = start + args.seconds
    done = 0
    while time.monotonic() < end:
        c = a @ b
        done += 1
    torch.cuda.synchronize()
    elapsed = time.monotonic() - start
    del c
    return {"steps": done, "seconds": elapsed, "rate": done / elapsed}


def training_step():
    """A small MLP's training step, set up; returns the step."""
    import torch

    torch.manual_seed(0)
    width = 4096
    model = torch.nn.Sequential(
        torch.nn.Linear(width, width),
        torch.nn.GELU(),
        torch.nn.Linear(width, width),
        torch.nn.GELU(),
        torch.nn.Linear(width, 10),
    ).cuda()
    optimiser = torch.optim.AdamW(model.parameters(), lr=1e-4)
    inputs = torch.randn(512, width, device="cuda")
    labels = torch.randint(0, 10, (512,), device="cuda")

    def step():
        optimiser.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(inputs), labels)
        loss.backward()
        optimiser.step()

    return step


def cublas_step():
    import torch

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)

    def step():
        for _ in range(4):
            torch.mm(a, b)

    return step


def launch_step():
    import torch

    x = torch.ones(1024, device="cuda")

    def step():
        for _ in range(200):
            x.mul_(1.0001)
            x.sub_(0.0001)

    return step


def median_step_seconds(step, chunks: int, steps_per_chunk: int) -> float:
    import torch

    times = []
    for _ in range(chunks):
        start = time.monotonic()
        for _ in range(steps_per_chunk):
            step()
        torch.cuda.synchronize()
        times.append((time.monotonic() - start) / steps_per_chunk)
    return statistics.median(times)


def warmed(*steps):
    import torch

    for step in steps:
        for _ in range(20):
            step()
    torch.cuda.synchronize()


def train(args) -> dict:
    step = training_step()
    warmed(step)
    ready_then_wait_for_go()
    return {"step_seconds": median_step_seconds(step, args.chunks, args.steps_per_chunk)}


def cost(args) -> dict:
    steps = {"train_seconds": training_step(), "cublas_seconds": cublas_step(), "launch_seconds": launch_step()}
    warmed(*steps.values())
    ready_then_wait_for_go()
    return {name: median_step_seconds(step, args.chunks, args.steps_per_chunk) for name, step in steps.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    modes = parser.add_subparsers(dest="mode", required=True)
    loop = modes.add_parser("matmul")
    loop.add_argument("--seconds", type=float, required=True)
    loop.add_argument("--size", type=int, default=8192)
    training = modes.add_parser("train")
    training.add_argument("--chunks", type=int, required=True)
    training.add_argument("--steps-per-chunk", type=int, default=10)
    costs = modes.add_parser("cost")
    costs.add_argument("--chunks", type=int, required=True)
    costs.add_argument("--steps-per-chunk", type=int, default=10)
    args = parser.parse_args()
    report_and_hold({"matmul": matmul, "train": train, "cost": cost}[args.mode](args))


if __name__ == "__main__":
    main()
