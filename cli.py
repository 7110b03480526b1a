"""`sluice`: one command over the product's parts, dispatching to each: the gateway's commands
(gateway/commands.py: serve, ingest, ask, tenants, models), evals (evals/__main__.py) and the
router lab (evals/lab/train.py). It stands above them so that they stand side by side.

Exit codes: 0 done, 2 bad arguments or bad files (the message says which and why).
"""
from __future__ import annotations

import argparse
import sys

from evals.lab.train import add_command as add_train_router
from gateway.commands import UsageError, add_commands
from gateway.config import ConfigError, load_server_config
from gateway.errors import GatewayError
from models.store import StoreError


def cmd_eval(args, config) -> int:
    from evals.__main__ import main as evals_main
    return evals_main(args.args, prog="sluice eval")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sluice", description="Sluice: a workload-aware RAG gateway")
    parser.add_argument("--config", help="server config TOML (engine models, prices, queue sizes); "
                                         "default: built-in defaults, see docs/gateway.md")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_commands(sub)
    add_train_router(sub)
    # Everything after `eval` is the evals command line (python -m evals), help included.
    evals = sub.add_parser("eval", add_help=False, help="run evals: quality, cost and latency per mode "
                                                        "(`sluice eval --help`; docs/evals.md)")
    evals.add_argument("args", nargs=argparse.REMAINDER)
    evals.set_defaults(run=cmd_eval)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    # Known args only: argparse hands a leading option after `eval` (`sluice eval --help`) to
    # the extras, not to eval's remainder; every other command takes none.
    args, extra = parser.parse_known_args(argv)     # exits 2 with a message on bad arguments
    if args.command == "eval":
        args.args = extra + args.args
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return args.run(args, load_server_config(args.config))
    except (UsageError, ConfigError, StoreError, GatewayError, ValueError) as e:   # RetrievalError is a ValueError
        message = e.message if isinstance(e, GatewayError) else str(e)
        print(f"sluice: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
