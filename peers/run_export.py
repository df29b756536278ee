"""run_export: a peer's outer state (the anchor) as a transformers model directory.

Usage:
    run_export --checkpoint runs/peer0 --out exports/peer0            # the newest checkpoint in a peer's log dir
    run_export --checkpoint runs/peer0/checkpoints/round_000040 --out exports/r40
    run_export --checkpoint runs/sim --out exports/sim                  # a simulation's final_state
    # then, offline:
    python -c 'from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained("exports/peer0"); tok = AutoTokenizer.from_pretrained("exports/peer0")'

--out gets config.json, generation_config.json, model.safetensors, the tokenizer and p2p_diloco_export.json (the
checkpoint, round and checksum it came from). Exit codes: 0 exported; 2 bad input (no checkpoint there, a missing,
partial or corrupt one, a config that does not fit it, --out taken); 1 anything unexpected.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from p2p_diloco.checkpoint import CheckpointError
from p2p_diloco.config import ConfigError
from p2p_diloco.data import DataError
from p2p_diloco.export import ExportError, export_checkpoint


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="run_export",
        description="Write a checkpoint's outer state as a transformers model directory.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    p.add_argument(
        "--checkpoint", type=Path, required=True, help="a peer's log dir, one checkpoint dir, or a simulation's --out"
    )
    p.add_argument("--out", type=Path, required=True, help="the directory to write (new, empty, or an earlier export)")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier export in --out")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S"
    )
    try:
        export_checkpoint(args.checkpoint, args.out, overwrite=args.overwrite)
    except (CheckpointError, ConfigError, DataError, ExportError) as exc:
        print(f"run_export: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
