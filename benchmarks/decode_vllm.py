"""The vLLM rollout backend's decode throughput beside HFRollout's: ``benchmarks/decode.py`` with
``--backends hf,vllm`` at batch 128 (kept as a name for the commands earlier notes give; all the
logic is decode.py's). Run in the environment with the vllm extra::

    .venv-vllm/bin/python benchmarks/decode_vllm.py --quick   # 8 new tokens
    .venv-vllm/bin/python benchmarks/decode_vllm.py           # 32 new tokens

``--batch N`` is decode.py's ``--batches N``, ``--skip-hf`` its ``--backends vllm``; other flags
pass through to decode.py.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], add_help=True)
    p.add_argument("--batch", type=int, default=128, help="rows per generate call")
    p.add_argument("--skip-hf", action="store_true", help="time only the vLLM backend")
    args, rest = p.parse_known_args(argv)
    import decode

    decode.main(["--batches", str(args.batch), "--backends", "vllm" if args.skip_hf else "hf,vllm"] + rest)


if __name__ == "__main__":
    main()
