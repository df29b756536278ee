"""run_monitor: watch a p2p_diloco swarm (peers, round, loss, tokens/s) from a DHT node that trains nothing.

Usage:
    # watch run "tiny-demo" (configs/tiny.yaml's swarm.run_id), history in runs/monitor, page on port 8080
    run_monitor --initial-peers /ip4/127.0.0.1/tcp/31337/p2p/QmXyZ... --run-id tiny-demo --out runs/monitor --port 8080
    #   http://127.0.0.1:8080/         live page (numbers from /status, plots)
    #   http://127.0.0.1:8080/status   JSON summary;   /metrics  Prometheus text format
    # behind NAT or a firewall that blocks incoming connections:
    run_monitor --initial-peers ... --run-id tiny-demo --out runs/monitor --client-mode
    # a closed run: the peers' config gives swarm.run_id and swarm.authorized_keys (unlisted peers are ignored)
    run_monitor --initial-peers ... --config configs/tiny.yaml --out runs/monitor
    run_monitor --initial-peers ... --run-id tiny-demo --authorized-keys keys.txt --out runs/monitor
    # samples: every 300 s, the state the swarm vouches for continues a fixed prompt (page, /status, monitor.jsonl);
    # --config and --set must be the peers' own (the model and the data give the fingerprint the state is checked with)
    run_monitor --initial-peers ... --config configs/tiny.yaml --out runs/monitor --port 8080 --samples
    run_monitor ... --config configs/tiny.yaml --set inner.steps=5 --samples --sample-every 60 --sample-prompt "def "
    # PNG plots from a monitor history and peers' logs (written to runs/monitor/plots/ unless --plot-out)
    run_monitor --plot runs/monitor --peer-logs runs/peer0 runs/peer1

Every --interval seconds it reads the run's per-peer records, prints one status line when something changed
(a redrawn table on a terminal) and appends a JSON line to OUT/monitor.jsonl (a restart continues the file).
Its DHT node runs the swarm's validators (p2p_diloco/swarm/validators.py: signatures, the guard on every key, the
run's schemas and record bounds); what they refuse is counted as bad records.
With --samples, a thread downloads the outer state the swarm vouches for every --sample-every seconds (as a client:
the monitor serves nothing), puts its anchor into the run's model and shows the greedy continuation of
--sample-prompt; a failed attempt is logged with its reason and retried at the next (p2p_diloco/monitor_samples.py).
Exit codes: 0 stopped by SIGINT/SIGTERM (or plots written); 2 bad input (address, busy port, nothing to plot, a bad
config or authorized-keys file, --samples without --config or in a closed run, the run's data or tokenizer missing
here); 3 no initial peer answered; 1 anything unexpected.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
from pathlib import Path

from p2p_diloco.config import Config, ConfigError, SwarmConfig, load_config
from p2p_diloco.data import DataError
from p2p_diloco.monitor import DEFAULT_EVERY, DEFAULT_PROMPT, DEFAULT_TOKENS, HISTORY_FILE, ConsoleView, Monitor
from p2p_diloco.monitor_http import PlotCache, PortInUseError, bind
from p2p_diloco.plots import write_plots
from p2p_diloco.stopping import StopRequest, skip_exit_collection
from p2p_diloco.swarm.dht import (
    SwarmSetupError,
    SwarmUnreachableError,
    add_initial_peers_argument,
    initial_peers_from_env,
    parse_initial_peers,
    shutdown_dht,
    start_dht,
)
from p2p_diloco.swarm.identity import Admission, IdentityError, read_authorized_keys
from p2p_diloco.swarm.reader import RejectCounter
from p2p_diloco.swarm.validators import make_validators

CLOSED_RUN_SAMPLES = (
    "--samples does not work in a closed run: peers serve their state only to listed peers, and the monitor has no "
    "listed key; run the monitor without --samples"
)
STOP_HANG_REPORT_S = 25.0  # a stop normally ends the monitor in about 3 s; stacks on stderr if not after this


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="run_monitor",
        description="Monitor a p2p_diloco swarm, or render plots of a run (--plot).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    add_initial_peers_argument(p)
    p.add_argument("--out", type=Path, help="directory for monitor.jsonl (and plots/)")
    p.add_argument(
        "--config", type=Path, help="the peers' YAML config: gives the default --run-id and --authorized-keys"
    )
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.FIELD=VALUE",
        help="an override of --config, as the peers were given (--samples needs the peers' exact settings)",
    )
    p.add_argument(
        "--run-id",
        default=None,
        help=f"the peers' swarm.run_id (default: --config's, else {SwarmConfig().run_id})",
    )
    p.add_argument(
        "--authorized-keys",
        type=Path,
        metavar="FILE",
        help="closed run: public keys whose records count, one a line (default: --config's swarm.authorized_keys)",
    )
    p.add_argument("--interval", type=float, default=5.0, help="seconds between refreshes (default %(default)s)")
    p.add_argument("--port", type=int, default=None, help="HTTP port for /, /status, /metrics (0: any free one)")
    p.add_argument("--http-host", default="127.0.0.1", help="HTTP listen address (0.0.0.0: all interfaces)")
    p.add_argument("--client-mode", action="store_true", help="accept no incoming DHT connections (behind NAT)")
    p.add_argument("--host-maddrs", nargs="*", default=None, help="DHT listen addresses (default /ip4/0.0.0.0/tcp/0)")
    p.add_argument("--announce-maddrs", nargs="*", default=None, help="public DHT addresses, when behind NAT")
    p.add_argument("--join-timeout", type=float, default=30.0, help="seconds to reach an initial peer")
    p.add_argument("--peer-logs", nargs="*", type=Path, default=[], metavar="DIR", help="peers' log dirs to plot")
    p.add_argument("--plot", type=Path, metavar="DIR", help="render PNGs from DIR/monitor.jsonl (+ --peer-logs), exit")
    p.add_argument("--plot-out", type=Path, metavar="DIR", help="where --plot writes PNGs (default DIR/plots)")
    p.add_argument(
        "--samples",
        action="store_true",
        help="now and then download the state the swarm vouches for and show a continuation of --sample-prompt "
        "(needs --config, and --set as the peers have it)",
    )
    p.add_argument(
        "--sample-every",
        type=float,
        default=DEFAULT_EVERY,
        metavar="SECONDS",
        help="seconds between samples (default %(default)g): each one downloads the whole state",
    )
    p.add_argument("--sample-prompt", default=DEFAULT_PROMPT, help="the fixed prompt (default %(default)r)")
    p.add_argument(
        "--sample-tokens", type=int, default=DEFAULT_TOKENS, metavar="N", help="tokens per sample (default %(default)s)"
    )
    return p.parse_args(argv)


def _fail(message: str, code: int) -> int:
    print(f"run_monitor: {message}", file=sys.stderr, flush=True)
    return code


def run_config(args: argparse.Namespace) -> Config | None:
    """--config with its --set overrides (and --run-id's run id), or None without --config. Raises ConfigError."""
    if args.config is None:
        if args.overrides:
            raise ConfigError(f"--set {args.overrides[0]} needs --config FILE: the config it overrides")
        return None
    run_id = [f"swarm.run_id={args.run_id}"] if args.run_id is not None else []
    return load_config(args.config, [*args.overrides, *run_id])


def run_settings(args: argparse.Namespace, cfg: Config | None) -> tuple[str, Admission | None]:
    """(run id, whose records count: None for any peer's) from the flags and ``cfg`` (run_config's): a closed run's
    listed keys, and ``swarm.identity_work``. Raises IdentityError."""
    swarm = cfg.swarm if cfg is not None else SwarmConfig()
    run_id = args.run_id if args.run_id is not None else swarm.run_id
    keys = args.authorized_keys if args.authorized_keys is not None else swarm.authorized_keys
    return run_id, Admission.of(read_authorized_keys(keys) if keys is not None else None, swarm.identity_work)


def check_sample_flags(args: argparse.Namespace) -> str | None:
    """Why the --samples flags cannot work (a line), or None."""
    if not args.samples:
        return None
    if args.config is None:
        return (
            "--samples needs --config FILE (and the --set overrides the peers run with): the state is checked "
            "against the run's fingerprint and loaded into the run's model, both made from that config"
        )
    if not (math.isfinite(args.sample_every) and args.sample_every > 0):
        return f"--sample-every {args.sample_every} must be a number of seconds > 0 (default {DEFAULT_EVERY:g})"
    if args.sample_tokens < 1:
        return f"--sample-tokens {args.sample_tokens} must be >= 1 (default {DEFAULT_TOKENS})"
    return None


def plot(args: argparse.Namespace) -> int:
    out = args.plot_out or args.plot / "plots"
    try:
        paths = write_plots(out, args.plot / HISTORY_FILE, args.peer_logs)
    except FileNotFoundError as exc:
        return _fail(f"{exc}; pass the monitor's --out directory and/or peers' --log-dir with --peer-logs", 2)
    print("\n".join(str(p) for p in paths), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S"
    )
    logging.getLogger("hivemind").setLevel(logging.ERROR)
    if args.plot is not None:
        return plot(args)
    if args.out is None:
        return _fail("--out DIR is required (where monitor.jsonl goes); or use --plot DIR", 2)
    if args.interval <= 0:
        return _fail(f"--interval {args.interval} must be > 0 seconds", 2)
    bad = check_sample_flags(args)
    if bad is not None:
        return _fail(bad, 2)
    try:
        cfg = run_config(args)
        run_id, authorized = run_settings(args, cfg)
    except (ConfigError, IdentityError) as exc:
        return _fail(str(exc), 2)
    if args.samples and authorized is not None:
        return _fail(CLOSED_RUN_SAMPLES, 2)

    request = StopRequest(report_hang_after=STOP_HANG_REPORT_S)
    request.interrupt = True  # a signal during the join aborts it (start_dht cleans up)
    stop, server, dht, samples = request.event, None, None, None
    try:
        initial = args.initial_peers if args.initial_peers is not None else initial_peers_from_env()
        initial = parse_initial_peers(initial)
        try:
            args.out.mkdir(parents=True, exist_ok=True)
            with (args.out / HISTORY_FILE).open("a"):
                pass
        except OSError as exc:
            return _fail(f"cannot write the history to {args.out / HISTORY_FILE}: {exc}; pick another --out", 2)
        monitor: Monitor | None = None
        if args.port is not None:  # bind before joining: a busy port fails in a second, not after the join
            plots = PlotCache(args.out / HISTORY_FILE, args.peer_logs)
            refresh_ms = int(args.interval * 1000)
            server = bind(
                args.http_host, args.port, lambda: monitor.latest if monitor else None, refresh_ms, plots, args.samples
            )
        rejects = RejectCounter(make_validators(run_id, None), run_id)
        dht = start_dht(
            initial,
            host_maddrs=args.host_maddrs,
            announce_maddrs=args.announce_maddrs,
            client_mode=args.client_mode,
            join_timeout=args.join_timeout,
            record_validators=[rejects],
        )
        rejects.close_host_end()
        if args.samples:  # before any thread of ours runs: its averager is a forked process
            from p2p_diloco.monitor_samples import StateSampler  # torch and transformers: only for --samples

            samples = StateSampler.build(
                dht,
                cfg,
                authorized,
                prompt=args.sample_prompt,
                max_new_tokens=args.sample_tokens,
                every=args.sample_every,
                stop=stop,
            )
        monitor = Monitor(
            dht,
            run_id,
            args.out,
            args.interval,
            rejects,
            ConsoleView(sys.stdout),
            stop,
            authorized=authorized,
            samples=samples,
        )
        closed = f" (closed: {len(authorized)} authorized peers)" if authorized is not None else ""
        print(f"monitor {dht.peer_id} watching run {run_id!r}{closed}; history: {monitor.history.path}", flush=True)
        if samples is not None:
            print(
                f"samples every {args.sample_every:g}s of the state the swarm vouches for (fingerprint "
                f"{samples.fingerprint}): {args.sample_tokens} tokens after {args.sample_prompt!r}",
                flush=True,
            )
        if server is not None:
            server.start()
            print(f"monitor page: {server.url}  (/status, /metrics)", flush=True)
        request.interrupt = False
        if not stop.is_set():
            monitor.run()
        return 0
    except SwarmUnreachableError as exc:
        return _fail(str(exc), 3)
    except (SwarmSetupError, PortInUseError, ConfigError, DataError) as exc:
        return _fail(str(exc), 2)
    except KeyboardInterrupt:
        return 0
    except RuntimeError as exc:
        return _fail(str(exc), 1)
    finally:
        request.ignore()  # a second Ctrl-C must not interrupt the cleanup
        if server is not None:
            server.close()
        if samples is not None:
            samples.close()
        if dht is not None:
            shutdown_dht(dht)
        request.close()


if __name__ == "__main__":
    sys.exit(skip_exit_collection(main()))
