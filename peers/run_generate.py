"""run_generate: text from a trained model, printed to stdout (the prompt, then the continuation; logs on stderr).

Usage:
    run_generate --checkpoint runs/peer0 --prompt "The list type" --max-new-tokens 80      # a peer's log dir
    run_generate --checkpoint runs/peer0/checkpoints/round_000040 --prompt "def " --temperature 0   # greedy
    run_generate --checkpoint exports/peer0 --prompt "The list type" --seed 3               # run_export's output

The same checkpoint, prompt, --max-new-tokens, --temperature and --seed give the same text (on the same device).
Generation stops early when the model ends the document (eos). Exit codes: 0 done; 2 bad input (no model there, a
corrupt checkpoint, --max-new-tokens < 0, --temperature < 0); 1 anything unexpected.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from p2p_diloco.checkpoint import CheckpointError
from p2p_diloco.config import ConfigError
from p2p_diloco.data import DataError
from p2p_diloco.generate import GenerateError, check_generation_args, generate, load_generator


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="run_generate",
        description="Continue a prompt with a trained model.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    p.add_argument(
        "--checkpoint",
        type=Path,
        required=True,
        help="a peer's log dir, one checkpoint dir, a simulation's --out, or an export (run_export --out)",
    )
    p.add_argument("--prompt", default="", help="text to continue (default: empty, the start of a document)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="at most this many tokens (default 64)")
    p.add_argument("--temperature", type=float, default=0.8, help="0: greedy; above: sampled (default 0.8)")
    p.add_argument("--seed", type=int, default=0, help="the sampling seed (default 0)")
    p.add_argument("--device", default="cpu", help="cpu (default), cuda or cuda:N")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S"
    )
    try:
        check_generation_args(args.max_new_tokens, args.temperature)  # before the model loads
        model, tokenizer = load_generator(args.checkpoint, args.device)
        sample = generate(model, tokenizer, args.prompt, args.max_new_tokens, args.temperature, args.seed)
    except (CheckpointError, ConfigError, DataError, GenerateError) as exc:
        print(f"run_generate: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    logging.getLogger("run_generate").info(
        "%d new tokens%s", len(sample.token_ids), ", stopped at eos" if sample.stopped_at_eos else ""
    )
    print(sample.prompt + sample.text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
