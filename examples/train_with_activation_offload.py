"""Training with activation offload: compile, step, compare with no offload, print the schedule.

    python -m hostswap.examples.train_with_activation_offload [--device cuda] [--compiler eager]
"""

import argparse
import copy

import torch
from torch import nn

import hostswap
from hostswap.models import DecoderBlock


class Decoder(nn.Module):
    def __init__(self, layers=6, hidden=64, heads=4):
        super().__init__()
        self.layers = nn.ModuleList(DecoderBlock(hidden, heads, 4 * hidden, llama=False) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def train_step(model, backend, x):
    torch._dynamo.reset()
    step = torch.compile(model, backend=backend)
    loss = step(x).float().pow(2).mean()
    loss.backward()
    return loss.detach(), [p.grad for p in model.parameters()]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--compiler", default="inductor", choices=["inductor", "eager"])
    parser.add_argument("--plot", default=None, help="write the schedule's timeline here (.svg/.png)")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    model = Decoder().to(args.device)
    x = torch.randn(2, 128, 64, device=args.device)

    plain = hostswap.activation_offload_backend(model_layers=6, num_layers=0, compiler=args.compiler)
    loss0, grads0 = train_step(copy.deepcopy(model), plain, x)
    backend = hostswap.activation_offload_backend(model_layers=6, num_layers=3, compiler=args.compiler, min_tensor_size_to_offload=0)
    loss1, grads1 = train_step(copy.deepcopy(model), backend, x)

    print(backend.schedule.table())
    same = torch.equal(loss0, loss1) and all(torch.equal(a, b) for a, b in zip(grads0, grads1))
    print(f"\noffloaded {backend.synchronizer.bytes_offloaded} bytes this step; "
          f"loss and gradients bitwise equal to no offload: {same}")
    if args.plot:
        backend.schedule.plot(args.plot)
        print(f"timeline written to {args.plot}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
