"""`weir serve` flags of the responses store (read by registry.py's Runs.from_options)."""

from __future__ import annotations


def add_arguments(s) -> None:
    """Add the flags to the `serve` parser."""
    r = s.add_argument_group("responses API store")
    r.add_argument(
        "--responses-store",
        metavar="PATH",
        help="keep responses in this SQLite "
        "file, so conversations survive a restart (default: in memory)",
    )
    r.add_argument(
        "--responses-store-max-entries",
        type=int,
        default=10_000,
        help="stored responses kept; the oldest finished ones go first",
    )
    r.add_argument(
        "--responses-store-ttl",
        type=float,
        default=24 * 3600.0,
        help="seconds a finished response is kept",
    )
    r.add_argument(
        "--disable-responses-store",
        action="store_true",
        help="keep no responses (no previous_response_id, background or GET)",
    )
