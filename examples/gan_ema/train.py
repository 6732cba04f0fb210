"""A loop only its author could write: a GAN's two models with two optimizers, stepped in turn,
and an exponential moving average (EMA) of the generator, evaluated beside it. The run handle
keeps all five (both models, both optimizers, the EMA) and each rank's random streams: a
preempted run resumes exactly where it stopped. The data: a mixture of two Gaussians in 1-D."""

import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from hpc.run import start_run


def real_samples(n: int, generator: torch.Generator | None = None) -> torch.Tensor:
    sign = torch.randint(0, 2, (n, 1), generator=generator) * 2 - 1
    return 2.0 * sign + 0.5 * torch.randn(n, 1, generator=generator)


def distance_to_real(generator_model: nn.Module, noise: torch.Tensor, real: torch.Tensor) -> float:
    """The 1-D Wasserstein distance between generated and real samples (sorted, paired)."""
    with torch.no_grad():
        fake = generator_model(noise).flatten().sort().values
    return (fake - real.flatten().sort().values).abs().mean().item()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--eval-every", type=int, default=250)
    parser.add_argument("--run-dir", default=None)  # started by hand (torchrun); launch.py gives its own
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()

    torch.manual_seed(0)  # the same initial weights on every rank
    generator = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
    critic = nn.Sequential(nn.Linear(1, 64), nn.LeakyReLU(0.2), nn.Linear(64, 64), nn.LeakyReLU(0.2), nn.Linear(64, 1))
    g_opt = torch.optim.Adam(generator.parameters(), lr=1e-3, betas=(0.5, 0.999))
    d_opt = torch.optim.Adam(critic.parameters(), lr=1e-3, betas=(0.5, 0.999))
    ema = AveragedModel(generator, multi_avg_fn=get_ema_multi_avg_fn(0.99))
    held_out = torch.Generator().manual_seed(7)
    eval_noise, eval_real = torch.randn(4096, 8, generator=held_out), real_samples(4096, held_out)
    torch.manual_seed(1 + rank)  # each rank draws its own batches and noise (a resume restores the streams)

    run = start_run(args.run_dir, generator=generator, critic=critic, g_opt=g_opt, d_opt=d_opt, ema=ema)
    g, d = DistributedDataParallel(generator), DistributedDataParallel(critic)
    bce = nn.functional.binary_cross_entropy_with_logits
    ones, zeros = torch.ones(args.batch, 1), torch.zeros(args.batch, 1)
    while run.step < args.steps:
        real, fake = real_samples(args.batch), g(torch.randn(args.batch, 8))
        # The critic: real against generated samples, in one forward (DDP syncs once per backward).
        d_loss = bce(d(torch.cat([real, fake.detach()])), torch.cat([ones, zeros]))
        d_opt.zero_grad()
        d_loss.backward()
        d_opt.step()
        # The generator: make the critic call its samples real (the critic's gradients are discarded).
        g_loss = bce(d(fake), ones)
        g_opt.zero_grad()
        g_loss.backward()
        g_opt.step()
        ema.update_parameters(generator)
        if run.end_step(d_loss=d_loss, g_loss=g_loss):  # every rank alike: True = stop now (saved)
            break
        if run.step % args.eval_every == 0:  # the same weights on every rank: rank 0's figures are everyone's
            run.log(val_w1=distance_to_real(generator, eval_noise, eval_real), val_w1_ema=distance_to_real(ema, eval_noise, eval_real))
    run.finish()  # the final checkpoint; after a stop, the process ends here and the job resumes

    if run.is_main:
        w1, w1_ema = distance_to_real(generator, eval_noise, eval_real), distance_to_real(ema, eval_noise, eval_real)
        print(f"trained {run.step} steps: distance to the real data {w1:.3f}, of the EMA generator {w1_ema:.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
