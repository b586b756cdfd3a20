"""The `memproxy` command's entry point: for `serve`, the stop signals are handled from here on.

Importing `memproxy.cli` (pydantic, the store drivers), then for `serve` `memproxy.daemon` (aiohttp,
the app), takes about half a second, and a SIGTERM in that time must stop `serve` as one later
does (`memproxy.stopping`). So this module installs the handler first and imports the command
after it. The other commands keep Python's own signal behaviour: an interrupted `check-config` or
`sessions ...` must not exit 0.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from .stopping import Stopped, stop_signals


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    # The command is the first argument: the parser has no global option but --version and --help.
    if args[:1] == ["serve"]:
        stop_signals.install()
    try:
        from .cli import main as run  # after the handler: `serve`'s imports take ~0.5 s

        return run(args)
    except Stopped:  # during the import, before `serve` began: nothing is open
        return 0


if __name__ == "__main__":
    sys.exit(main())
