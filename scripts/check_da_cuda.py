"""FedeCouple's batched augmentation on a GPU against the per-image loop it replaced (the test's reference): how many
pixels differ on CUDA, and against the CPU. The CPU equality is a test (tests/test_label_skew_baselines.py); on a GPU
the batched grid product may round a rotation's grid coordinate differently from one image's, moving a pixel at an
exact tie of the nearest sampling. Run from the repository root on the GPU machine:

    PYTHONPATH=src:. python scripts/check_da_cuda.py

Prints, over 200 batches of 50 Office-sized images (3 x 32 x 32, max_crop 4, ±30°): the batches and pixels that
differ between the batched and the per-image augmentation on CUDA, and between CUDA and the CPU."""

from __future__ import annotations

import torch
from tests.test_label_skew_baselines import _one_random_op_per_image

from fedsilo.client.data import one_random_op
from fedsilo.config import NormalizeParams


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device")
    data = torch.Generator().manual_seed(0)
    stats = {"batched vs per-image (cuda)": [0, 0], "cuda vs cpu (batched)": [0, 0]}
    pixels = 0
    for seed in range(200):
        x = torch.rand(50, 3, 32, 32, generator=data) * 2 - 1
        xc = x.cuda()
        batched = one_random_op(xc, torch.Generator().manual_seed(seed), NormalizeParams()).cpu()
        loop = _one_random_op_per_image(xc, torch.Generator().manual_seed(seed)).cpu()
        cpu = one_random_op(x, torch.Generator().manual_seed(seed), NormalizeParams())
        pixels += batched.numel()
        for key, (a, b) in {"batched vs per-image (cuda)": (batched, loop), "cuda vs cpu (batched)": (batched, cpu)}.items():
            diff = int((a != b).sum())
            stats[key][0] += diff > 0
            stats[key][1] += diff
    for key, (batches, diff) in stats.items():
        print(f"{key}: {batches} of 200 batches differ, {diff} of {pixels} values ({diff / pixels:.2e})")


if __name__ == "__main__":
    main()
