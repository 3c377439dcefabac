"""The decode kernel's key splits swept on the GPU: TB/s of K/V read per forced split count against
the automatic choice (kernels/decode_plan.decode_splits), dense bf16 d128 decode rows of docs/decode.md.

    python benchmarks/decode_splits.py [--splits 1,2,3,4,6,8,12,16,24,32] [--extra]
"""

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script on a machine where the package is not installed
    sys.path.insert(0, str(ROOT))

from attention_dispatch.kernels.decode import decode_forward
from attention_dispatch.kernels.decode_plan import decode_splits, tiles
from attention_dispatch.kernels.device import device_info
from attention_dispatch.kernels.params import KernelParams
from benchmarks.decode import timed

ROWS = [  # (label, B, Hq, Hkv, S)
    ("gqa B=64 Sk=4k", 64, 32, 8, 4096),
    ("gqa B=8 Sk=32k", 8, 32, 8, 32768),
    ("mha B=64 Sk=4k", 64, 32, 32, 4096),
    ("mha B=8 Sk=32k", 8, 32, 32, 32768),
    ("gqa B=1 Sk=128k", 1, 32, 8, 131072),
    ("gqa B=64 uniform 1..32k", 64, 32, 8, 32768),  # lengths drawn uniformly (docs/decode.md's row)
]
EXTRA_ROWS = [  # other grids for a rule's check (--extra)
    ("gqa B=16 Sk=16k", 16, 32, 8, 16384),
    ("gqa B=32 Sk=8k", 32, 32, 8, 8192),
    ("gqa B=128 Sk=2k", 128, 32, 8, 2048),
    ("mha B=16 Sk=8k", 16, 32, 32, 8192),
    ("mha B=32 Sk=16k", 32, 32, 32, 16384),
    ("gqa B=16 uniform 1..64k", 16, 32, 8, 65536),
]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--splits", default="1,2,3,4,5,6,8,10,12,16,20,24,32")
    p.add_argument("--extra", action="store_true", help="also EXTRA_ROWS")
    a = p.parse_args(argv)
    counts = [int(x) for x in a.splits.split(",")]
    sms = device_info(torch.device("cuda"))[2]
    print(f"{torch.cuda.get_device_name()}, {sms} SMs")
    for label, B, Hq, Hkv, S in ROWS + (EXTRA_ROWS if a.extra else []):
        q = torch.randn(B, Hq, 1, 128, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(B, Hkv, S, 128, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        lens = torch.full((B,), S, dtype=torch.int32)
        if "uniform" in label:
            lens = torch.randint(1, S + 1, (B,), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
        nbytes = int(lens.sum()) * Hkv * 128 * 2 * 2
        lens = lens.cuda()
        params = KernelParams(scale=128**-0.5, align_bottom_right=True)
        row_blocks = tiles(Hq // Hkv, 1, 128)[3]
        auto = decode_splits(B * Hkv * row_blocks, S, sms)
        cells = []
        for n in [0] + counts:
            ms = timed(lambda: decode_forward(q, k, v, lens, params, num_splits=n))
            cells.append(f"{'auto=' + str(auto) if n == 0 else n}:{nbytes / ms / 1e9:.2f}")
        print(f"{label:<16} programs without splits {B * Hkv * row_blocks:>4}  TB/s " + " ".join(cells), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
